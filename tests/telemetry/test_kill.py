"""A real lake-writer process killed with SIGKILL, then restarted: nothing lost, nothing duplicated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from telemetry.emitter import stream_key
from tests.telemetry.conftest import REDIS_URL, wait_until
from tests.telemetry.test_lake_writer import _assert_exact, _emit_requests, _no_backlog

ROOT = Path(__file__).resolve().parents[2]


def _spawn(prefix: str, lake: Path, mode: str, ready: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "tests.telemetry.writer_proc", REDIS_URL, prefix, str(lake), "w0", mode]
    return subprocess.Popen([*args, str(ready)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_sigkill_after_write_before_ack(make_emitter, make_writer, lake, r, prefix, tmp_path):
    e = make_emitter(start=False, batch_size=100)
    sent = _emit_requests(e, 500, hours_back=1)
    e.flush()
    ready = tmp_path / "ready"
    proc = _spawn(prefix, lake, "hang", ready)
    try:
        wait_until(ready.exists, timeout_s=60, what="the writer to write its first part")
    finally:
        _kill(proc)
    assert list(lake.rglob("*.parquet")), "the killed writer had written files"
    assert r.xpending(stream_key(prefix, "requests"), "lake")["pending"] >= 1
    make_writer().drain()  # restart under the same consumer name
    _assert_exact(lake, sent)
    _no_backlog(r, prefix)


def test_sigkill_while_consuming(make_emitter, make_writer, lake, r, prefix, tmp_path):
    e = make_emitter(start=False, batch_size=20)
    sent = _emit_requests(e, 2000, hours_back=1)
    e.flush()
    ready = tmp_path / "ready"
    proc = _spawn(prefix, lake, "run", ready)
    try:
        wait_until(lambda: len(list(lake.rglob("part-*.parquet"))) >= 6, timeout_s=60, what="some parts")
    finally:
        _kill(proc)
    left = r.xlen(stream_key(prefix, "requests"))
    assert left > 0, "killed before it finished"
    make_writer().drain()
    _assert_exact(lake, sent)
    _no_backlog(r, prefix)
