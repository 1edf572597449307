"""Prometheus metrics of the router and the nodes, all named ``tandem_*``.

One ``TandemMetrics`` object holds every metric, registered in one ``CollectorRegistry``. A process
uses the default instance ``METRICS`` (registered in prometheus-client's default registry, which
``prometheus_client.make_asgi_app()`` serves on ``/metrics``); tests build their own on a fresh
registry, so nothing is registered twice.

    tandem_ttft_seconds{model}                      histogram, time to first token
    tandem_itl_seconds{model}                       histogram, inter-token latency (per-request mean
                                                    from observe_request; observe_itl() per token)
    tandem_e2e_seconds{model}                       histogram, end-to-end latency
    tandem_requests_total{model,status}             counter, finished requests by status
    tandem_node_queue_depth{node,role}              gauge, requests waiting in the node's engine
    tandem_node_running{node,role}                  gauge, requests running in the node's engine
    tandem_tokens_total{model,kind}                 counter, kind = prompt | completion | cached
    tandem_hit_tokens_total{model,level}            counter, level = fleet | routed | engine;
                                                    hit rate = rate(hit_tokens) / rate(tokens{prompt})
    tandem_kv_transfer_bytes_total                  counter, KV bytes moved P -> D
    tandem_kv_transfer_seconds                      histogram, KV transfer time per request
    tandem_telemetry_queue_length                   gauge, events waiting in the emitter's buffer
    tandem_telemetry_dropped_events_total{table,reason}
                                                    counter, slow-path events lost: buffer_full,
                                                    redis_unavailable, stream_full, invalid, closed
    tandem_telemetry_sent_events_total{table}       counter, events the emitter put in Redis
    tandem_lake_written_events_total{table}         counter, events the lake writer put in Parquet
    tandem_lake_dead_letter_entries_total{table}    counter, stream entries the lake writer could not
                                                    decode, moved to ``<stream>:dead``
    tandem_lake_unwritable                          gauge, 1 while the lake cannot be written (disk full,
                                                    I/O error) and the writer backs off, else 0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

# Latencies from 10 ms to 60 s (TTFT, E2E, transfers): roughly x1.5-2 per step.
LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
)  # fmt: skip
# Inter-token latency lives lower (a few ms to a few hundred ms); same upper reach for stalls.
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
)  # fmt: skip

DROP_REASONS = ("buffer_full", "redis_unavailable", "stream_full", "invalid", "closed")


class TandemMetrics:
    """Every ``tandem_*`` metric, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        r = registry
        self.registry = registry
        self.ttft = Histogram(
            "tandem_ttft_seconds", "Time to first token", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram("tandem_itl_seconds", "Inter-token latency", ["model"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "tandem_e2e_seconds", "End-to-end request latency", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.requests = Counter("tandem_requests", "Finished requests by status", ["model", "status"], registry=r)
        self.queue_depth = Gauge(
            "tandem_node_queue_depth", "Requests waiting in a node's engine", ["node", "role"], registry=r
        )
        self.running = Gauge("tandem_node_running", "Requests running in a node's engine", ["node", "role"], registry=r)
        self.tokens = Counter(
            "tandem_tokens", "Tokens by kind (prompt, completion, cached)", ["model", "kind"], registry=r
        )
        self.hit_tokens = Counter(
            "tandem_hit_tokens",
            "Prompt tokens found cached: fleet (anywhere), routed (chosen node), engine (reused)",
            ["model", "level"],
            registry=r,
        )
        self.transfer_bytes = Counter(
            "tandem_kv_transfer_bytes", "KV bytes moved from prefill to decode nodes", registry=r
        )
        self.transfer_seconds = Histogram(
            "tandem_kv_transfer_seconds", "KV transfer time per request", buckets=LATENCY_BUCKETS, registry=r
        )
        self.telemetry_queue_length = Gauge(
            "tandem_telemetry_queue_length", "Events waiting in the telemetry emitter's buffer", registry=r
        )
        self.dropped_events = Counter(
            "tandem_telemetry_dropped_events",
            "Slow-path telemetry events dropped, by table and reason",
            ["table", "reason"],
            registry=r,
        )
        self.sent_events = Counter(
            "tandem_telemetry_sent_events", "Telemetry events written to Redis", ["table"], registry=r
        )
        self.lake_written_events = Counter(
            "tandem_lake_written_events",
            "Telemetry events written to the Parquet lake",
            ["table"],
            registry=r,
        )

        self.lake_dead_letter_entries = Counter(
            "tandem_lake_dead_letter_entries",
            "Telemetry stream entries the lake writer could not decode (moved to the dead-letter stream)",
            ["table"],
            registry=r,
        )
        self.lake_unwritable = Gauge(
            "tandem_lake_unwritable", "1 while the lake cannot be written (disk full, I/O error)", registry=r
        )

    def observe_request(self, record: Mapping[str, Any]) -> None:
        """Update the request metrics from one ``requests`` record (the dict given to the emitter).
        Missing or null fields are skipped."""
        model = record.get("model") or "unknown"
        self.requests.labels(model, record.get("status") or "unknown").inc()
        for key, hist in (("ttft_s", self.ttft), ("itl_mean_s", self.itl), ("e2e_s", self.e2e)):
            v = record.get(key)
            if v is not None:
                hist.labels(model).observe(v)
        for key, kind in (
            ("prompt_tokens", "prompt"),
            ("completion_tokens", "completion"),
            ("cached_tokens", "cached"),
        ):
            v = record.get(key)
            if v:
                self.tokens.labels(model, kind).inc(v)
        for key, level in (
            ("fleet_cached_tokens", "fleet"),
            ("routed_cached_tokens", "routed"),
            ("engine_cached_tokens", "engine"),
        ):
            v = record.get(key)
            if v:
                self.hit_tokens.labels(model, level).inc(v)
        tb = record.get("transfer_bytes")
        if tb:
            self.transfer_bytes.inc(tb)
        ts = record.get("transfer_s")
        if ts is not None:
            self.transfer_seconds.observe(ts)

    def observe_itl(self, model: str, seconds: float) -> None:
        """One inter-token gap, for callers that time every token."""
        self.itl.labels(model).observe(seconds)

    def set_node_load(self, node: str, role: str, *, waiting: int, running: int) -> None:
        """The node agent (or the router, from the registry) reports an engine's queue."""
        self.queue_depth.labels(node, role).set(waiting)
        self.running.labels(node, role).set(running)


METRICS = TandemMetrics()
"""The process-wide instance, in prometheus-client's default registry."""


def observe_request(record: Mapping[str, Any]) -> None:
    """``METRICS.observe_request(record)``."""
    METRICS.observe_request(record)
