"""What every benchmark does to the processes it starts: wait for one to answer over HTTP, and read how much
CPU one took (whole ticks from ``psutil``, or the scheduler's nanosecond counters for short windows)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import httpx
import psutil

from contracts.errors import ConfigError


def wait_http(url: str, alive: Callable[[], bool], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise ConfigError(f"process behind {url} exited during start-up")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)  # polling a child that has no readiness callback
    raise ConfigError(f"{url} not ready after {timeout_s:.0f} s")


def cpu_s(pid: int) -> float:
    """User+system seconds of a process and its children (vllm-router runs in one process; the
    Tandem router too), 0 when it is gone."""
    try:
        p = psutil.Process(pid)
        total = sum(p.cpu_times()[:2])
        for c in p.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += sum(c.cpu_times()[:2])
        return total
    except psutil.NoSuchProcess:
        return 0.0


def sched_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` from the scheduler's nanosecond counters
    (``/proc/<pid>/task/*/schedstat``): for windows of a few tens of ms, where ``cpu_times``'s 10 ms
    ticks would be most of the figure. Falls back to ``cpu_s`` where there is no such file."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return cpu_s(pid)
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    return total / 1e9
