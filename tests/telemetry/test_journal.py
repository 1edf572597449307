"""The emitter's journal (telemetry.journal): events of a process killed before it flushed are sent by
the next one with the same journal directory, once each; a Redis outage keeps them on disk until it
ends; delivered segments leave nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import redis

from telemetry.emitter import stream_key
from telemetry.journal import Journal, read_segment
from tests.telemetry.conftest import REDIS_URL, closed_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _rows(r: redis.Redis, prefix: str) -> list[dict]:
    out: list[dict] = []
    for _id, fields in r.xrange(stream_key(prefix, "requests")):
        out += pa.ipc.open_stream(fields[b"a"]).read_all().select(["event_id", "request_id"]).to_pylist()
    return out


def _emit(e, n: int, tag: str) -> None:  # noqa: ANN001
    for i in range(n):
        e.emit("requests", {"request_id": f"{tag}-{i}", "status": "ok", "prompt_tokens": i})


def test_a_process_killed_before_flushing_loses_nothing(r, prefix, make_emitter, tmp_path) -> None:  # noqa: ANN001
    journal, ready = tmp_path / "journal", tmp_path / "ready"
    child = textwrap.dedent(
        f"""
        import pathlib, time
        from telemetry.emitter import Emitter, EmitterConfig
        e = Emitter(EmitterConfig(redis_url={REDIS_URL!r}, stream_prefix={prefix!r}, source="dead",
                                  flush_interval_s=3600, journal_dir=pathlib.Path({str(journal)!r})))
        for i in range(50):
            e.emit("requests", {{"request_id": f"dead-{{i}}", "status": "ok", "prompt_tokens": i}})
        pathlib.Path({str(ready)!r}).touch()
        time.sleep(3600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_until(ready.exists, timeout_s=60, what="the child to emit")
    finally:
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    assert _rows(r, prefix) == []  # it never flushed
    e = make_emitter(start=False, journal_dir=journal)  # the restarted process
    _emit(e, 5, "new")
    e.flush()
    rows = _rows(r, prefix)
    assert sorted(x["request_id"] for x in rows) == sorted(
        [f"dead-{i}" for i in range(50)] + [f"new-{i}" for i in range(5)]
    )
    assert len({x["event_id"] for x in rows}) == 55
    # The dead process's rows went first, and delivered segments are gone: only the open one is left.
    assert [x["request_id"] for x in rows[:50]] == [f"dead-{i}" for i in range(50)]
    assert len(list(journal.glob("*.seg"))) == 1


def test_a_redis_outage_keeps_the_events_until_it_ends(r, prefix, make_emitter, metrics, tmp_path) -> None:  # noqa: ANN001
    journal = tmp_path / "journal"
    down = make_emitter(start=False, journal_dir=journal, redis_url=f"redis://127.0.0.1:{closed_port()}/0")
    _emit(down, 20, "outage")
    assert down.flush() == 0
    down.close()  # the process ends while Redis is still away
    assert sum(1 for seg in journal.glob("*.seg") for _ in read_segment(seg)) == 20
    back = make_emitter(start=False, journal_dir=journal)
    back.flush()
    rows = _rows(r, prefix)
    assert sorted(x["request_id"] for x in rows) == sorted(f"outage-{i}" for i in range(20))
    # Sent twice (e.g. delivered, then killed before the delete): the ids say it is the same event.
    ids = {x["event_id"] for x in rows}
    assert len(ids) == 20


def test_a_torn_last_frame_is_ignored_and_the_rest_read(tmp_path) -> None:  # noqa: ANN001
    j = Journal(tmp_path)
    for i in range(3):
        j.append("requests", {"request_id": f"r{i}"}, float(i))
    seg = j.rotate()
    with seg.open("ab") as f:
        f.write(b"\x40\x00\x00\x00partial")  # a frame announcing 64 bytes, cut after 7
    assert [rec["request_id"] for _, rec, _ in read_segment(seg)] == ["r0", "r1", "r2"]


def test_undelivered_segments_are_bounded(tmp_path) -> None:  # noqa: ANN001
    j = Journal(tmp_path, max_bytes=2_000)
    kept = []
    for k in range(10):
        for i in range(10):
            j.append("requests", {"request_id": f"{k}-{i}", "pad": "x" * 20}, 0.0)
        kept.append(j.rotate())
    kept, lost = j.trim(kept)
    assert sum(p.stat().st_size for p in kept) <= 2_000 and lost == 10 * (10 - len(kept))
    assert all(p.exists() for p in kept) and kept == sorted(kept)[-len(kept) :]
