"""The lake writer runs at idle CPU priority (SCHED_IDLE, nice 19), every thread of it, and still
writes everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from telemetry.priority import CpuPriority, apply_cpu_priority
from telemetry.query import query
from tests.telemetry.conftest import REDIS_URL, wait_until
from tests.telemetry.test_lake_writer import _emit_requests

ROOT = Path(__file__).resolve().parents[2]
SCHED_IDLE = 5


def _threads_policy_and_nice(pid: int) -> set[tuple[int, int]]:
    """(scheduling policy, nice) of every thread of ``pid`` (proc(5): fields 41 and 19)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        out.add((int(fields[38]), int(fields[16])))
    return out


def _lake_rows(lake: Path) -> int:
    return query(lake, "SELECT count(*) AS n FROM requests").to_pylist()[0]["n"]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_consume_runs_sched_idle_and_writes_everything(make_emitter, lake, prefix, tmp_path):
    args = [
        sys.executable,
        "-m",
        "tandem",
        "telemetry",
        "consume",
        "--redis-url",
        REDIS_URL,
        "--lake",
        str(lake),
        "--stream-prefix",
        prefix,
        "--consumer",
        "idle-test",
        "--block-ms",
        "100",
    ]
    log = (tmp_path / "writer.log").open("wb")
    proc = subprocess.Popen(
        args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        e = make_emitter(start=False, batch_size=50)
        sent = _emit_requests(e, 300)
        e.flush()
        wait_until(
            lambda: bool(list(lake.rglob("*.parquet"))) and _lake_rows(lake) == len(sent),
            timeout_s=60,
            what="the idle-priority writer to write every event",
        )
        assert _threads_policy_and_nice(proc.pid) == {(SCHED_IDLE, 19)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert "CPU priority: SCHED_IDLE, nice 19" in (tmp_path / "writer.log").read_text()


def test_normal_priority_leaves_the_process_alone():
    before = os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)
    assert apply_cpu_priority(CpuPriority.NORMAL) == "normal"
    assert (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)) == before
