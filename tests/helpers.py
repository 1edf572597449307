"""Small helpers shared by tests."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; returns its last value. For state in
    other processes that offers no notification (engine metrics, files, registry keys)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def alive_pids(pids: set[int]) -> list[int]:
    """The processes of ``pids`` still running (zombies, whose parent has not reaped them, count as gone)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out
