"""The host a benchmark ran on, as its JSON results record it: results from different hosts differ by
4-8x per engine step, so every result says where it came from, how fast it is and how busy it was.

Two probes make hosts comparable where the CPU model name does not (a VM reports `Intel(R) Xeon(R)
Processor` whatever it runs on):

- ``python_loop_10m_s``: the CPU seconds of ten million steps of an empty Python loop (timed over one
  million and scaled): the interpreter's speed, which bounds the router's and node agents' work.
  Measured hosts: 0.24 s (a 2-core AMX Xeon VM) to 2.0 s (a slow 2-core EPYC VM).
- ``wakeup_us``: the on-CPU time of one wake-up of a thread that slept 1 s, from the scheduler's
  nanosecond counter (median of three). Where the vCPU stays with the guest this is a few interpreter
  steps and a system call: 60-100 us on a 2-core Xeon VM (Firecracker, guest `haltpoll`) while another
  benchmark kept its cores busy. The same VM idle charged 3,052 us per wake-up after 2 s asleep, 395 us
  after 0.2 s and 127 us after 20 ms: figures that fit a wake-up first waiting for the hypervisor to give
  the vCPU and its memory back, charged as the woken process's CPU. There an idle router read 16 ms of
  CPU a second and vllm-router 1.07, and every per-request CPU figure at an engine's pace carries that
  cost: compare such figures only between hosts whose probes are alike, and within a run as ratios.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

LOOP_STEPS = 1_000_000
WAKEUPS = 3
SLEEP_S = 1.0


def cpu_model(cpuinfo: str | None = None) -> str | None:
    """The first ``model name`` of ``/proc/cpuinfo`` (None off Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return None


def python_loop_10m_s(steps: int = LOOP_STEPS) -> float:
    """CPU seconds of ten million empty loop steps, timed over ``steps`` and scaled."""
    # At module scope, as `python3 -c "for i in range(10_000_000): pass"` runs it (the figure the
    # benchmark pages quote for their hosts): a global store per step, slower than a function's local.
    t = time.thread_time()
    exec(f"for i in range({steps}): pass", {})
    return round((time.thread_time() - t) * 10_000_000 / steps, 3)


def wakeup_us(wakeups: int = WAKEUPS, sleep_s: float = SLEEP_S) -> float:
    """Median on-CPU microseconds of one wake-up after ``sleep_s`` asleep (see the module docstring)."""
    costs = []
    for _ in range(wakeups):
        t = time.thread_time_ns()  # the scheduler's own count of this thread's time (not ticks)
        time.sleep(sleep_s)  # the idle being probed: nothing to wait for
        costs.append((time.thread_time_ns() - t) / 1000)
    return round(sorted(costs)[len(costs) // 2], 1)


def host_probe() -> dict[str, Any]:
    """The CPU model and the two probes (about ``WAKEUPS * SLEEP_S`` seconds)."""
    return {"cpu_model": cpu_model(), "python_loop_10m_s": python_loop_10m_s(), "wakeup_us": wakeup_us()}


def host_record(load_before: tuple[float, float, float], probe: dict[str, Any] | None = None) -> dict[str, Any]:
    """Cores, host name, the 1-minute load average before the run (``load_before``) and now, and the
    host's probes (``probe``, taken before the run; else now)."""
    return {
        "cpus": os.cpu_count(),
        "node": platform.node(),
        "loadavg_1m_before": round(load_before[0], 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        **(probe if probe is not None else host_probe()),
    }
