"""The router's Prometheus metrics (all ``tandem_`` prefixed), served at ``/metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    """One instance per app, on its own registry (tests build many apps in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("tandem_ttft_seconds", "Time to first token", ["mode"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem_itl_seconds", "Inter-token latency", ["mode"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("tandem_e2e_seconds", "Request latency, arrival to last token", ["mode"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_leg = Histogram("tandem_prefill_leg_seconds", "Prefill leg duration (P/D only)",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("tandem_requests_total", "Requests by outcome", ["endpoint", "mode", "status"],
                                registry=r)
        self.errors = Counter("tandem_errors_total", "Errors by type", ["type"], registry=r)
        self.fallbacks = Counter("tandem_prefill_fallbacks_total", "P/D requests prefilled on the decode node "
                                 "because the prefill leg failed", registry=r)
        self.tokens = Counter("tandem_tokens_total", "Tokens by kind", ["kind"], registry=r)
        self.inflight = Gauge("tandem_node_inflight_requests", "Requests this router has in flight per node",
                              ["node", "role"], registry=r)
        self.queue_depth = Gauge("tandem_node_queue_depth", "Requests waiting in each engine (last heartbeat)",
                                 ["node", "role"], registry=r)
        self.kv_usage = Gauge("tandem_node_kv_usage_ratio", "KV cache usage per node (last heartbeat)",
                              ["node", "role"], registry=r)
        self.live_nodes = Gauge("tandem_live_nodes", "Live nodes by role", ["role"], registry=r)
