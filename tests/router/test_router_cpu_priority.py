"""The router process runs SCHED_BATCH by default, every thread of it (those started after the policy
was set inherit it), so its wake-ups never preempt an engine's thread; ``normal`` leaves it as started
(with the policy it inherited from this test process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.standin_engine import free_port
from tests.support.standin_cluster import REDIS_URL
from tests.telemetry.test_priority import _threads_policy_and_nice

ROOT = Path(__file__).resolve().parents[2]
SCHED_BATCH = 3
INHERITED = os.sched_getscheduler(0)


def _router(tmp_path: Path, **env: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem", "router", "--port", str(port), "--redis-url", REDIS_URL],
        cwd=ROOT,
        env={
            **os.environ,
            "TANDEM_DATABASE_URL": f"sqlite:///{tmp_path}/r.db",
            "TANDEM_ROUTER_TELEMETRY": "true",
            **env,
        },
        stdout=(tmp_path / "router.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=2) as client:
        for _ in range(600):  # up to ~60 s for a cold start on 2 cores
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "router.log").read_text()[-2000:])
            try:
                client.get(f"{url}/health")
                return proc, url
            except httpx.TransportError:
                try:
                    proc.wait(timeout=0.1)  # a bounded poll of a child that has no readiness signal
                except subprocess.TimeoutExpired:
                    pass
    proc.kill()
    raise AssertionError("router did not answer /health")


@pytest.mark.parametrize(("setting", "policy"), [(None, SCHED_BATCH), ("normal", INHERITED)])
def test_every_router_thread_has_the_configured_policy(tmp_path: Path, setting: str | None, policy: int) -> None:
    env = {"TANDEM_ROUTER_CPU_PRIORITY": setting} if setting else {}
    proc, url = _router(tmp_path, **env)
    try:
        with httpx.Client(timeout=10) as client:
            client.get(f"{url}/v1/models")  # a request served: the threads it needs exist
        threads = _threads_policy_and_nice(proc.pid)
        assert len(threads) >= 1 and {p for p, _ in threads} == {policy}, threads
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    expected = "SCHED_BATCH" if setting is None else "normal"
    assert f"CPU priority: {expected}" in (tmp_path / "router.log").read_text()
