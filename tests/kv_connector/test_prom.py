"""The connector's engine-side metrics: every key of a worker's stats snapshot lands in its own
``tandem_kv_*`` metric, per engine (vLLM's own metric classes, a private registry)."""

from __future__ import annotations

import types
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kv_connector.prom import TandemPromMetrics


def _metrics() -> tuple[TandemPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()

    def bound(cls: Any) -> Any:
        def init(self: Any, *args: Any, **kw: Any) -> None:
            kw.setdefault("registry", registry)
            cls.__init__(self, *args, **kw)

        return type(cls.__name__, (cls,), {"__init__": init})

    types_ = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    cfg = types.SimpleNamespace(kv_transfer_config=None)
    return TandemPromMetrics(cfg, types_, ["engine"], {0: ["0"], 1: ["1"]}), registry


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("tandem_kv") and "_created" not in line and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_every_snapshot_key_lands_in_its_metric_per_engine() -> None:
    metrics, registry = _metrics()
    snapshot = {
        "recv_seconds": [0.01, 0.02],
        "recv_bytes": [100, 200],
        "recv_blocks": 3,
        "failed_transfers": 1,
        "recv_failed": 2,
        "unauthenticated": 4,
        "peer_refused": 5,
        "leases_active": 6,
        "leased_blocks": 7,
        "leases_sending": 8,
        "pulls_active": 9,
        "lease_outcomes": {"released": 2, "expired": 1},
    }
    metrics.observe(snapshot, engine_idx=1)
    metrics.observe({"leases_active": 1}, engine_idx=1)  # a gauge is a level: the latest wins
    got = _samples(registry)
    e = '{engine="1"}'
    assert got[f"tandem_kv_transfer_seconds_count{e}"] == 2
    assert got[f"tandem_kv_transfer_bytes_total{e}"] == 300
    assert got[f"tandem_kv_transfer_blocks_total{e}"] == 3
    assert got[f"tandem_kv_transfer_failures_total{e}"] == 3
    assert got[f"tandem_kv_unauthenticated_total{e}"] == 4
    assert got[f"tandem_kv_peer_refused_total{e}"] == 5
    assert got[f"tandem_kv_leases_active{e}"] == 1
    assert got[f"tandem_kv_leased_blocks{e}"] == 0  # absent from the latest snapshot: nothing held
    assert got['tandem_kv_lease_outcomes_total{engine="1",outcome="released"}'] == 2
    assert got['tandem_kv_transfer_bytes_total{engine="0"}'] == 0  # the other engine untouched
