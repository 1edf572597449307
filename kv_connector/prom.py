"""vLLM's side of the transfer statistics: the stats object it aggregates across steps and workers,
and the ``tandem_kv_*`` Prometheus metrics it records them into, in the engine's API-server process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kv_transfer.stats import COUNTS, GAUGES, LISTS


@dataclass
class TandemKVStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {**{k: [] for k in LISTS}, **{k: 0 for k in COUNTS}, "lease_outcomes": {}, **{k: 0 for k in GAUGES}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        o = other.data
        for k in LISTS:
            self.data[k] = list(self.data.get(k, [])) + list(o.get(k, []))
        for k in COUNTS:
            self.data[k] = self.data.get(k, 0) + o.get(k, 0)
        outcomes = dict(self.data.get("lease_outcomes", {}))
        for k, v in o.get("lease_outcomes", {}).items():
            outcomes[k] = outcomes.get(k, 0) + v
        self.data["lease_outcomes"] = outcomes
        for k in GAUGES:  # a level, not a sum over time: the latest wins
            self.data[k] = o.get(k, self.data.get(k, 0))
        self.data["changed"] = bool(self.data.get("changed") or o.get("changed"))
        return self

    def reduce(self) -> dict[str, int | float]:
        secs, nbytes = self.data["recv_seconds"], self.data["recv_bytes"]
        return {
            "transfers": len(secs),
            "bytes": sum(nbytes),
            "blocks": self.data["recv_blocks"],
            "avg_seconds": round(sum(secs) / len(secs), 4) if secs else 0.0,
            "GB/s": round(sum(nbytes) / sum(secs) / 1e9, 3) if secs and sum(secs) else 0.0,
            "failed": self.data["failed_transfers"] + self.data["recv_failed"],
            "leases_active": self.data["leases_active"],
        }

    def is_empty(self) -> bool:
        d = self.data
        # The worker sends a snapshot only when something moved, gauges included: a lease count
        # falling to zero is news the metrics must get.
        return not any(d.get(k) for k in (*LISTS, *COUNTS, "lease_outcomes", "changed"))


_COUNTERS = {
    "recv_bytes": ("tandem_kv_transfer_bytes", "KV bytes received (decode side)."),
    "recv_blocks": ("tandem_kv_transfer_blocks", "KV blocks received (decode side)."),
    "failed": ("tandem_kv_transfer_failures", "Pulls that failed (refused, timed out, bad checksum)."),
    "unauthenticated": (
        "tandem_kv_unauthenticated",
        "KV control frames refused for a bad or missing MAC (prefill side).",
    ),
    "peer_refused": (
        "tandem_kv_peer_refused",
        "Pulls refused: an shm pull over tcp, or from a peer whose socket credentials differ from what it claims.",
    ),
}
"""Counters per engine: key -> (metric name, help); ``observe`` says what each counts."""
_GAUGES = {
    "leases_active": ("tandem_kv_leases_active", "Leases held now (prefill side)."),
    "leased_blocks": ("tandem_kv_leased_blocks", "KV blocks held under leases now (prefill side)."),
    "leases_sending": ("tandem_kv_leases_sending", "Leases whose transfer is under way (prefill side)."),
    "pulls_active": (
        "tandem_kv_pulls_active",
        "Pulls under way now (decode side; a layer-wise one while its prefill computes).",
    ),
}
"""Gauges per engine (a level: the latest snapshot's wins): the snapshot's key -> (metric name, help)."""


class TandemPromMetrics(KVConnectorPromMetrics):
    """``tandem_kv_*`` metrics in the engine's API-server process."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, per_engine_labelvalues)

        # vLLM types these as a union of prometheus classes; each is called with its own keywords.
        h: Any = self._histogram_cls
        c: Any = self._counter_cls
        g: Any = self._gauge_cls
        buckets = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
        self.recv_seconds = per_engine(
            h(
                name="tandem_kv_transfer_seconds",
                buckets=buckets,
                documentation="Time to pull one request's KV (decode side).",
                labelnames=labelnames,
            )
        )
        self.counters = {
            key: per_engine(c(name=name, documentation=doc, labelnames=labelnames))
            for key, (name, doc) in _COUNTERS.items()
        }
        self.gauges = {
            key: per_engine(g(name=name, multiprocess_mode="mostrecent", documentation=doc, labelnames=labelnames))
            for key, (name, doc) in _GAUGES.items()
        }
        self._outcome_counter = c(
            name="tandem_kv_lease_outcomes",
            documentation="Leases ended, by outcome.",
            labelnames=[*labelnames, "outcome"],
        )
        self._labels = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for s in d.get("recv_seconds", []):
            self.recv_seconds[engine_idx].observe(s)
        counts = {
            "recv_bytes": sum(d.get("recv_bytes", [])),
            "recv_blocks": d.get("recv_blocks", 0),
            "failed": d.get("failed_transfers", 0) + d.get("recv_failed", 0),
            "unauthenticated": d.get("unauthenticated", 0),
            "peer_refused": d.get("peer_refused", 0),
        }
        for key, n in counts.items():
            self.counters[key][engine_idx].inc(n)
        for key, per_engine in self.gauges.items():
            per_engine[engine_idx].set(d.get(key, 0))
        for outcome, n in d.get("lease_outcomes", {}).items():
            self._outcome_counter.labels(*self._labels[engine_idx], outcome).inc(n)
