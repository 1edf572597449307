"""Emitter -> stream -> lake writer -> Parquet -> DuckDB: exact rows, through crashes and compaction."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

import telemetry.lake_writer as lw
from telemetry.emitter import stream_key
from telemetry.lake_files import compact_partition
from telemetry.query import lake_files, query


def _emit_requests(e, n: int, *, start: int = 0, hours_back: int = 0) -> dict[str, int]:
    """n request records; every other one an hour earlier when hours_back (two partitions)."""
    now = time.time()
    sent = {}
    for i in range(start, start + n):
        rid = f"r{i}"
        e.emit(
            "requests",
            {
                "request_id": rid,
                "session_id": f"s{i % 3}",
                "prompt_tokens": i,
                "fleet_cached_tokens": i // 2,
                "status": "ok",
                "event_time": now - (i % 2) * 3600 * hours_back,
            },
        )
        sent[rid] = i
    return sent


def _lake_requests(lake: Path) -> list[tuple[str, int]]:
    return [
        (r["request_id"], r["prompt_tokens"])
        for r in query(lake, "SELECT request_id, prompt_tokens FROM requests ORDER BY prompt_tokens").to_pylist()
    ]


def _assert_exact(lake: Path, sent: dict[str, int]) -> None:
    got = _lake_requests(lake)
    assert len(got) == len(sent), f"{len(got)} rows in the lake, {len(sent)} sent"
    assert dict(got) == sent
    n, d = query(lake, "SELECT count(*), count(DISTINCT event_id) FROM requests").to_pylist()[0].values()
    assert n == d == len(sent)


def _no_backlog(r, prefix: str, group: str = "lake") -> None:
    key = stream_key(prefix, "requests")
    assert r.xpending(key, group)["pending"] == 0
    assert r.xlen(key) == 0
    assert not r.exists(f"{key}:lake:{group}:parts") and not r.exists(f"{key}:lake:{group}:owner")


def test_round_trip_gives_exactly_the_rows_emitted(make_emitter, make_writer, lake, r, prefix):
    e = make_emitter(batch_size=100, flush_interval_s=0.05)
    sent = _emit_requests(e, 1000, hours_back=1)
    e.emit("tool_calls", {"request_id": "r1", "tool_name": "read_file", "arguments": '{"path": "a.py"}'})
    e.emit("feedback", {"response_id": "chatcmpl-r1", "rating": -1, "comment": "wrong file", "labels": ["x"]})
    e.close()
    w = make_writer(batch_entries=3)
    stats = w.drain()
    assert stats.rows == 1002
    _assert_exact(lake, sent)
    hours = query(lake, "SELECT DISTINCT hour FROM requests").num_rows
    assert hours == 2
    tc = query(lake, "SELECT request_id, tool_name, arguments FROM tool_calls").to_pylist()
    assert tc == [{"request_id": "r1", "tool_name": "read_file", "arguments": '{"path": "a.py"}'}]
    fb = query(lake, "SELECT rating, comment, labels FROM feedback").to_pylist()
    assert fb == [{"rating": -1, "comment": "wrong file", "labels": ["x"]}]
    for p in lake.rglob("*.parquet"):
        assert p.parent.name.startswith("hour=") and p.parent.parent.name.startswith("date=")
    assert not list(lake.rglob("*.tmp"))
    _no_backlog(r, prefix)
    # Nothing more to do: a second drain writes nothing.
    assert w.drain().rows == 0


def test_crash_after_files_before_ack_then_restart(make_emitter, make_writer, lake, r, prefix):
    e = make_emitter(start=False, batch_size=50)
    sent = _emit_requests(e, 400, hours_back=1)
    e.flush()
    w = make_writer(batch_entries=4)
    entries = w.read_new(block_ms=0)["requests"]
    parts = w.plan("requests", entries)
    assert len(parts) == 1
    w.write_part(parts[0])  # ... and the writer dies before commit (XACK).
    w.close()
    assert r.xpending(stream_key(prefix, "requests"), "lake")["pending"] == 4
    restarted = make_writer(batch_entries=4)
    stats = restarted.drain()
    assert stats.redone_parts == 1
    _assert_exact(lake, sent)
    _no_backlog(r, prefix)


def test_crash_between_two_partition_files(make_emitter, make_writer, lake, r, prefix, monkeypatch):
    e = make_emitter(start=False, batch_size=100)
    sent = _emit_requests(e, 200, hours_back=1)  # one part spanning two hours
    e.flush()
    w = make_writer()
    real = lw.write_parquet_atomic
    calls = []

    def dies_on_second(*args, **kw):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(*args, **kw)

    monkeypatch.setattr(lw, "write_parquet_atomic", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        w.drain()
    monkeypatch.setattr(lw, "write_parquet_atomic", real)
    assert len(list(lake.rglob("*.parquet"))) == 1
    make_writer().drain()
    _assert_exact(lake, sent)
    _no_backlog(r, prefix)


def test_dead_consumer_entries_are_taken_over(make_emitter, make_writer, lake, r, prefix):
    e = make_emitter(start=False, batch_size=50)
    sent = _emit_requests(e, 300)
    e.flush()
    dead = make_writer(consumer="dead", batch_entries=2)
    batch = dead.read_new(block_ms=0)["requests"]
    part = dead.plan("requests", batch)[0]
    dead.write_part(part)  # dies here; its two entries have an intent, the rest were never read
    other = make_writer(consumer="other", claim_idle_s=0)
    other.drain()
    _assert_exact(lake, sent)
    # The dead writer "wakes up" and finishes its part: same files, nothing duplicated.
    dead.write_part(part)
    dead.commit(part)
    _assert_exact(lake, sent)
    _no_backlog(r, prefix)


def test_entries_are_deleted_after_commit_so_the_stream_length_is_the_backlog(make_emitter, make_writer, r, prefix):
    e = make_emitter(start=False, batch_size=10)
    _emit_requests(e, 100)
    e.flush()
    assert r.xlen(stream_key(prefix, "requests")) == 10
    make_writer(batch_entries=4).run_once(block_ms=0)
    assert r.xlen(stream_key(prefix, "requests")) == 6


def _many_parts(make_emitter, make_writer, n: int = 300) -> dict[str, int]:
    e = make_emitter(start=False, batch_size=30)
    sent = _emit_requests(e, n)
    e.flush()
    make_writer(batch_entries=1).drain()
    return sent


def test_compaction_merges_parts_without_losing_or_duplicating(make_emitter, make_writer, lake):
    sent = _many_parts(make_emitter, make_writer)
    before = sorted(query(lake, "SELECT * EXCLUDE (date, hour) FROM requests").to_pylist(), key=str)
    assert len(list(lake.glob("requests/*/*/part-*.parquet"))) == 10
    results = make_writer().compact(min_age_s=0)
    assert len(results) == 1 and len(results[0].inputs) == 10 and results[0].rows == 300
    assert len(list(lake.glob("requests/*/*/part-*.parquet"))) == 1
    after = sorted(query(lake, "SELECT * EXCLUDE (date, hour) FROM requests").to_pylist(), key=str)
    assert after == before
    _assert_exact(lake, sent)


def test_compaction_crash_before_deleting_inputs_is_invisible_and_completed(make_emitter, make_writer, lake, tmp_path):
    sent = _many_parts(make_emitter, make_writer, 90)
    pdir = next(lake.glob("requests/*/*"))
    saved = tmp_path / "saved"
    shutil.copytree(pdir, saved)
    res = compact_partition(pdir, min_age_s=0)
    # Recreate the state of a crash after the output's rename, before the inputs were deleted.
    for p in saved.glob("part-*.parquet"):
        shutil.copy2(p, pdir / p.name)
    digest = res.output[len("part-c") : -len(".parquet")]
    (pdir / f"_compact-{digest}.json").write_text(json.dumps({"inputs": res.inputs, "output": res.output}))
    assert len(list(pdir.glob("part-*.parquet"))) == 4
    assert len(lake_files(lake, "requests")) == 1
    _assert_exact(lake, sent)
    compact_partition(pdir, min_age_s=0)
    assert [p.name for p in pdir.iterdir()] == [res.output]
    _assert_exact(lake, sent)


def test_compaction_skips_parts_with_an_open_intent(make_emitter, make_writer, lake, r, prefix):
    sent = _many_parts(make_emitter, make_writer, 60)
    e = make_emitter(start=False, batch_size=30)
    sent.update(_emit_requests(e, 30, start=1000))
    e.flush()
    w = make_writer(consumer="crashing")
    part = w.plan("requests", w.read_new(block_ms=0)["requests"])[0]
    w.write_part(part)  # crash: intent open
    res = make_writer().compact(min_age_s=0)
    assert f"part-{part.part_id}.parquet" not in res[0].inputs
    assert (next(lake.glob("requests/*/*")) / f"part-{part.part_id}.parquet").exists()
    make_writer(consumer="crashing").drain()
    _assert_exact(lake, sent)
