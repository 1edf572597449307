"""The router's Prometheus metrics (all ``tandem_``), served at ``/metrics``.

Request-level metrics (TTFT, ITL, E2E, requests by status, tokens, hit rates, transfer bytes) are the
shared ``telemetry.TandemMetrics``, fed from the same record that goes to the lake, so the two never
disagree. The router adds what only it can see: the prefill leg, fallbacks, errors by type, and its
view of the fleet.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from telemetry.metrics import LATENCY_BUCKETS, TandemMetrics


class RouterMetrics:
    """One instance per app, on its own registry (tests build many apps in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.common = TandemMetrics(r)
        self.prefill_leg = Histogram("tandem_prefill_leg_seconds", "Prefill leg duration (P/D only)",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.errors = Counter("tandem_errors_total", "Errors by type", ["type"], registry=r)
        self.fallbacks = Counter("tandem_prefill_fallbacks_total", "P/D requests prefilled on the decode node "
                                 "because the prefill leg failed", registry=r)
        self.inflight = Gauge("tandem_node_inflight_requests", "Requests this router has in flight per node",
                              ["node", "role"], registry=r)
        self.kv_usage = Gauge("tandem_node_kv_usage_ratio", "KV cache usage per node (last heartbeat)",
                              ["node", "role"], registry=r)
        self.live_nodes = Gauge("tandem_live_nodes", "Live nodes by role", ["role"], registry=r)
