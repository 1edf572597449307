"""What every benchmark does to the processes it starts: wait for one to answer over HTTP, and read how much
CPU one took (whole ticks from ``psutil``, or the scheduler's nanosecond counters for short windows and
for per-request figures)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import httpx
import psutil

from contracts.errors import ConfigError
from contracts.secret import engine_auth_headers


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


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` set in this process's environment for the block, then put back as they were: every
    process started inside it inherits them (an arm's settings, a development flag for a cluster)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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


def outside_cpu_s() -> float:
    """CPU seconds the host has been busy so far outside this process and its descendants (steal
    included): over a run, what other users of the host took from its cores, where engines whose
    threads meet at every step stall on any of them. Descendants gone before the end are not subtracted."""
    t = psutil.cpu_times()
    busy = sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return busy - cpu_s(os.getpid())


class ThreadCpu:
    """CPU seconds of a process's threads (and its children's) from the scheduler's nanosecond counters,
    sampled: each thread counts with the last value seen, so a thread that exits between samples (a
    worker idled out) keeps what it had taken up to the sample before. Over a benchmark's 25-s window,
    ``cpu_s``'s 10 ms ticks are about 0.3 ms per request of the router's 4 ms at either end of it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._seen: dict[str, int] = {}

    def total(self) -> float:
        pids = [self.pid]
        with contextlib.suppress(psutil.Error):
            pids += [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
        for pid in pids:
            with contextlib.suppress(OSError):
                self._seen.update(_task_ns(pid))
        return sum(self._seen.values()) / 1e9


def _task_ns(pid: int) -> dict[str, int]:
    """Each thread of ``pid`` and its CPU so far, in ns (``/proc/<pid>/task/*/schedstat``); raises
    ``OSError`` when the process is gone or the kernel has no such files."""
    seen: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            seen[tid] = _cpu_ns(f"/proc/{pid}/task/{tid}")
    return seen


def _cpu_ns(task: str) -> int:
    """A thread's CPU so far, in ns, from its ``/proc/<pid>/task/<tid>`` folder (the scheduler's run time,
    the first field of ``schedstat``)."""
    with open(f"{task}/schedstat") as f:
        return int(f.read().split()[0])


@dataclass(frozen=True)
class ThreadStat:
    """One thread as the scheduler counts it: its name, CPU so far (ns), and how often it gave up its
    core by itself (``voluntary``: it waited, so each is a later wake-up) or had it taken
    (``involuntary``: preempted)."""

    name: str
    cpu_ns: int
    voluntary: int
    involuntary: int


def thread_stats(pid: int) -> dict[int, ThreadStat]:
    """Every thread of ``pid`` now, by thread id (``/proc/<pid>/task/*``); threads that end while it is
    read are left out."""
    stats: dict[int, ThreadStat] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        with contextlib.suppress(OSError, ValueError, IndexError):
            cpu_ns = _cpu_ns(base)
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            switches = {"voluntary_ctxt_switches": 0, "nonvoluntary_ctxt_switches": 0}
            with open(f"{base}/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in switches:
                        switches[key] = int(value)
            stats[int(tid)] = ThreadStat(
                name, cpu_ns, switches["voluntary_ctxt_switches"], switches["nonvoluntary_ctxt_switches"]
            )
    return stats


def sched_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` from the scheduler's nanosecond counters
    (``/proc/<pid>/task/*/schedstat``): for windows of a few tens of ms, where ``cpu_times``'s 10 ms
    ticks would be most of the figure. Falls back to ``cpu_s`` where there is no such file."""
    try:
        return sum(_task_ns(pid).values()) / 1e9
    except OSError:
        return cpu_s(pid)


def router_command(port: int, redis_url: str) -> list[str]:
    """A Tandem router process as benchmarks start it: on ``port``, its registry in ``redis_url`` (the caller
    adds options, and gives its settings as environment)."""
    return [sys.executable, "-m", "tandem", "router", "--port", str(port), "--redis-url", redis_url]


def served_model(url: str) -> str:
    """The first model an engine or router at ``url`` serves. A Tandem node's engine takes the cluster's
    engine key (an open engine ignores the header)."""
    resp = httpx.get(f"{url}/v1/models", headers=engine_auth_headers(loopback_only=True), timeout=10)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def stop_all(procs: list[subprocess.Popen[bytes]], grace_s: float = 20.0) -> None:
    """Stop processes in the reverse order of their start: SIGTERM, then SIGKILL after ``grace_s``."""
    for p in reversed(procs):
        p.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(grace_s)
        if p.poll() is None:
            p.kill()
            p.wait()
