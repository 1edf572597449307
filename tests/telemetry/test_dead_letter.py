"""The slow path never stops the fast path (issue 12): an entry the lake writer cannot decode goes to
the dead-letter stream while the rest is written, and a full disk makes the writer back off and resume
by itself when space returns, losing nothing. Real Redis, real files, a real (tiny) tmpfs."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from telemetry.emitter import stream_key
from telemetry.query import query
from tests.telemetry.conftest import sample, wait_until


def _emit(e, ids: range) -> None:  # noqa: ANN001 - the emitter fixture's product
    for i in ids:
        e.emit("requests", {"request_id": f"r{i}", "prompt_tokens": i, "status": "ok", "event_time": time.time()})
    e.flush()


def _rows(lake: Path) -> int:
    if not list(lake.rglob("*.parquet")):
        return 0
    return query(lake, "SELECT count(*) AS n FROM requests").to_pylist()[0]["n"]


@contextlib.contextmanager
def _running(writer) -> Iterator[None]:  # noqa: ANN001
    stop = threading.Event()
    t = threading.Thread(target=writer.run, args=(stop,), kwargs={"recover_every_s": 0.5}, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(30)
        assert not t.is_alive(), "the writer did not stop"


def test_a_malformed_entry_is_dead_lettered_while_the_rest_is_written(
    make_emitter, make_writer, lake, r, prefix, metrics
) -> None:
    e = make_emitter(batch_size=5, start=False)
    key = stream_key(prefix, "requests")
    w = make_writer(block_ms=50)
    w.ensure_groups()
    _emit(e, range(0, 10))
    garbage = r.xadd(key, {"a": b"\x00 not an arrow stream"}).decode()
    stranger = r.xadd(key, {"x": "an entry someone else wrote"}).decode()
    _emit(e, range(10, 20))
    with _running(w):
        wait_until(lambda: _rows(lake) == 20, what="the 20 good rows")
        _emit(e, range(20, 25))  # and it goes on writing
        wait_until(lambda: _rows(lake) == 25, what="rows emitted after the bad entries")
    dead = r.xrange(f"{key}:dead")
    assert [d[1][b"entry_id"].decode() for d in dead] == [garbage, stranger]
    assert dead[0][1][b"a"] == b"\x00 not an arrow stream" and b"ArrowInvalid" in dead[0][1][b"reason"]
    assert b"no Arrow payload" in dead[1][1][b"reason"]
    assert sample(metrics, "tandem_lake_dead_letter_entries_total", table="requests") == 2
    assert r.xlen(key) == 0 and r.xpending(key, "lake")["pending"] == 0  # nothing stuck behind them


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real file system that really fills up."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> Path:
    filler = path / "filler"
    with open(filler, "wb") as fh:
        with contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
    return filler


def test_a_full_disk_makes_the_writer_back_off_and_resume_when_space_returns(
    make_emitter, make_writer, tiny_disk, r, prefix, metrics, caplog
) -> None:
    lake = tiny_disk / "lake"
    lake.mkdir()
    filler = _fill(tiny_disk)
    key = stream_key(prefix, "requests")
    e = make_emitter(batch_size=10, start=False)
    w = make_writer(lake=lake, block_ms=50, unwritable_backoff_max_s=0.5)
    caplog.set_level(logging.WARNING, logger="telemetry.lake_writer")
    _emit(e, range(30))
    with _running(w):
        wait_until(lambda: sample(metrics, "tandem_lake_unwritable") == 1, what="the writer noticing the full disk")
        assert "disk full" in caplog.text
        assert _rows(lake) == 0 and r.xlen(key) > 0  # nothing written, nothing acknowledged, nothing lost
        filler.unlink()
        wait_until(lambda: _rows(lake) == 30, what="the rows once space returned")
        wait_until(lambda: sample(metrics, "tandem_lake_unwritable") == 0, what="the gauge clearing")
    assert "writable again" in caplog.text
    assert r.xlen(key) == 0 and r.xpending(key, "lake")["pending"] == 0
    assert not list(lake.rglob("*.tmp")), "temporary files left behind"
