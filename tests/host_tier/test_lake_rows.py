"""The tier's ``host_tier`` lake rows, in one process: deltas between two snapshots, evictions and
forgotten blocks split by reason into their columns, an interval's row only when it is due, and the
rows of a run summing to its counters (a real ``TierCore`` drives them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from host_tier import messages as m
from host_tier.arena import Arena
from host_tier.lake import TierIdentity, TierLake, interval_row
from host_tier.server import TierCore
from telemetry.batches import build_batch
from telemetry.schemas import SCHEMAS
from tests.host_tier.test_arena_and_core import FP, SLOT, Clock, key, put

ID = TierIdentity("h:/dev/shm/tandem-tier-ab", "h", "tiny", FP.hex())


def stats(**kw: Any) -> m.TierStats:
    base: dict[str, Any] = dict(
        n_slots=10, slot_bytes=100, held=0, writing=0, pinned=0, stored=0, hits=0, misses=0,
        evictions={}, forgotten={}, reclaimed=0,
    )  # fmt: skip
    return m.TierStats(**{**base, **kw})


def test_a_row_holds_the_gauges_at_its_end_and_the_deltas_over_it_by_reason() -> None:
    before = stats(held=4, stored=10, hits=5, misses=2, evictions={"lru": 3}, forgotten={"corrupt": 1}, demoted=1)
    after = stats(
        held=9, writing=1, pinned=3, stored=17, hits=12, misses=2, pinned_hits=4, pins_refused=2, demoted=3,
        reclaimed=1, evictions={"lru": 5, "pinned_lru": 1, "ttl": 2}, forgotten={"corrupt": 1, "stale": 3},
    )  # fmt: skip
    row = interval_row(ID, before, after, 100.0, 110.0)
    assert row["tier_id"] == ID.tier_id and row["layout_fingerprint"] == FP.hex()
    assert (row["interval_start"], row["interval_end"]) == (100.0, 110.0)
    gauges = ("slots", "slot_bytes", "blocks_held", "blocks_writing", "blocks_pinned", "pinned_bytes")
    assert [row[g] for g in gauges] == [10, 100, 9, 1, 3, 300]
    deltas = ("stored", "hits", "misses", "pinned_hits", "pins_refused", "demoted", "reclaimed")
    assert [row[d] for d in deltas] == [7, 7, 0, 4, 2, 2, 1]
    assert (row["evicted_lru"], row["evicted_pinned_lru"]) == (2, 1)
    assert json.loads(row["evicted_other"]) == {"ttl": 2}  # a reason without a column of its own
    assert row["forgotten_corrupt"] == 0 and json.loads(row["forgotten_other"]) == {"stale": 3}
    batch = build_batch("host_tier", [row], [110.0], "host-tier-h")  # the row fits the lake's schema
    assert batch.schema.equals(SCHEMAS["host_tier"]) and batch.num_rows == 1
    assert batch.column("evicted_lru").type == pa.int64()


def test_the_first_row_counts_from_zero_and_an_interval_without_other_reasons_has_null_json() -> None:
    row = interval_row(ID, None, stats(held=3, stored=3, evictions={"lru": 1}), 0.0, 10.0)
    assert (row["stored"], row["evicted_lru"], row["evicted_pinned_lru"], row["forgotten_corrupt"]) == (3, 1, 0, 0)
    assert row["evicted_other"] is None and row["forgotten_other"] is None
    assert row["blocks_held"] == 3


class Recorder:
    """The emitter's interface the lake uses (emit, close), keeping what it is handed."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.closed = False

    def emit(self, table: str, record: dict[str, Any]) -> bool:
        assert table == "host_tier"
        self.rows.append(record)
        return True

    def close(self) -> None:
        self.closed = True


def test_rows_are_emitted_once_per_interval_and_the_run_sums_to_the_tiers_counters(tmp_path: Path) -> None:
    clock = Clock()
    core = TierCore(Arena.create(tmp_path / "tier", SLOT, 4, FP), clock=clock)
    out = Recorder()
    lake = TierLake(out, ID, interval_s=10.0, clock=clock)  # type: ignore[arg-type]
    for i in range(3):
        put(core, i)
    calls = []
    clock.t += 9.0
    assert not lake.tick(lambda: calls.append(1) or core.stats())  # not due: not even a snapshot taken
    assert calls == [] and out.rows == []
    clock.t += 1.0
    assert lake.tick(core.stats)
    core.handle(m.Pin([key(0), key(1)], 60.0, owner="s", tenant="t"))
    for i in range(3, 7):  # 7 blocks into 4 slots: key(2) goes (lru), then key(3), key(4)
        put(core, i)
    core.handle(m.Lookup([key(0), key(1), key(2)]))  # two pinned hits, then a miss
    clock.t += 12.0
    assert lake.tick(core.stats)
    core.handle(m.Forget([key(0)]))
    clock.t += 3.0
    lake.close(core.stats())  # the last, partial interval
    assert out.closed
    first, second, last = out.rows
    assert (first["stored"], first["blocks_held"], first["evicted_lru"]) == (3, 3, 0)
    assert (second["stored"], second["evicted_lru"], second["hits"], second["pinned_hits"]) == (4, 3, 2, 2)
    assert (second["misses"], second["blocks_pinned"], second["pinned_bytes"]) == (1, 2, 2 * SLOT)
    assert (last["forgotten_corrupt"], last["stored"], last["interval_end"] - last["interval_start"]) == (1, 0, 3.0)
    assert [r["interval_end"] for r in out.rows[:-1]] == [r["interval_start"] for r in out.rows[1:]]  # no gap
    total = core.stats()
    for column, counter in (("stored", total.stored), ("hits", total.hits), ("pinned_hits", total.pinned_hits)):
        assert sum(r[column] for r in out.rows) == counter
    assert sum(r["evicted_lru"] + r["evicted_pinned_lru"] for r in out.rows) == sum(total.evictions.values())


def test_the_tier_writes_to_the_streams_the_lake_writer_reads_by_default() -> None:
    # (written out in the tier's settings, which engines load without the telemetry package)
    from host_tier.settings import TierSettings
    from telemetry.emitter import DEFAULT_STREAM_PREFIX

    assert TierSettings().telemetry_stream_prefix == DEFAULT_STREAM_PREFIX
