"""The benchmarks' CPU meters (bench.procs): nanosecond counters, threads that exit kept; per-thread CPU and
context switches."""

from __future__ import annotations

import os
import threading
import time

from bench.procs import ThreadCpu, thread_stats


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_thread_that_exits_keeps_the_cpu_it_was_seen_with() -> None:
    meter = ThreadCpu(os.getpid())
    start = meter.total()
    seen = threading.Event()

    def worker() -> None:
        _burn(0.05)
        seen.wait()  # the meter samples while this thread is alive, then it exits

    t = threading.Thread(target=worker)
    t.start()
    while t.is_alive() and not seen.is_set():
        if meter.total() - start >= 0.05:
            seen.set()
    t.join()
    after_exit = meter.total()
    assert after_exit - start >= 0.05  # the exited thread's 50 ms still count
    # Finer than the kernel's 10 ms ticks: 2 ms of work shows as about 2 ms.
    before = meter.total()
    _burn(0.002)
    assert 0.0015 <= meter.total() - before < 0.008


def test_thread_stats_name_each_thread_and_count_its_cpu_and_waits() -> None:
    pid = os.getpid()
    started, stop = threading.Event(), threading.Event()

    def worker() -> None:
        _burn(0.02)
        started.set()
        stop.wait()  # blocks: a voluntary switch, at the latest when it wakes

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    mid = thread_stats(pid)
    assert t.native_id in mid and pid in mid
    assert mid[t.native_id].cpu_ns >= 20_000_000  # its 20 ms of work
    stop.set()
    t.join()
    _burn(0.005)
    after = thread_stats(pid)
    assert t.native_id not in after  # gone once it ended
    assert after[pid].cpu_ns - mid[pid].cpu_ns >= 5_000_000
    assert after[pid].voluntary >= mid[pid].voluntary  # counters never go back
