"""The benchmarks' CPU meter (bench.procs.ThreadCpu): nanosecond counters, threads that exit kept."""

from __future__ import annotations

import os
import threading
import time

from bench.procs import ThreadCpu


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
