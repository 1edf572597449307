"""Process lifetimes: every process Tandem starts dies with whatever started it, and stopping a
process group means waiting until every member of it is gone.

Parent death. ``die_with_parent()`` returns a ``preexec_fn`` that sets ``PR_SET_PDEATHSIG`` in the child
before exec, so the kernel signals the child when its parent dies, even by SIGKILL. Chains of these
(``tandem up`` → node agent → engine; a bench → its cluster's processes) take a whole tree down when
its root dies. Two caveats the callers respect: the signal follows the death of the parent *thread*
that forked, so spawn from a thread that lives as long as the parent (the main thread); and a parent
that dies between fork and ``prctl`` would be missed, so the child checks its parent is still the one
that forked it and signals itself otherwise.

Groups. Engines and cluster children run in their own session (``start_new_session``), so one
``killpg`` reaches their helpers too (vLLM's engine core, its workers). ``stop_group`` signals the
group and waits until none of its members is left, escalating to SIGKILL: a port or a KV cache is
only free once the last member has exited, not when the leader has.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable

import psutil

_PR_SET_PDEATHSIG = 1
# Loaded here, in the parent: loading a library between fork and exec may deadlock on a lock another
# thread of the parent held at fork time.
_LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when the calling process dies."""
    parent = os.getpid()

    def preexec() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


def group_pids(pgid: int) -> list[int]:
    """Live processes (zombies excluded) whose process group is ``pgid``."""
    pids = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                pids.append(proc.pid)
    return pids


def group_state(pgid: int) -> tuple[list[int], float]:
    """Members of group ``pgid`` that are stopped (state T), and the group's CPU seconds (user+system)
    so far: one walk of the group for both of the supervisor's per-probe questions."""
    stopped, cpu = [], 0.0
    for pid in group_pids(pgid):
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_STOPPED:
                stopped.append(pid)
            t = p.cpu_times()
            cpu += t.user + t.system
    return stopped, cpu


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_group_gone(pgid: int, timeout_s: float, interval_s: float = 0.1) -> bool:
    """Wait until group ``pgid`` has no live member; True if it emptied in time. Polls: the kernel offers
    no notification for the exit of processes that are not our children."""
    deadline = time.monotonic() + timeout_s
    while group_pids(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def stop_group(pgid: int, *, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 20.0) -> None:
    """Send ``sig`` to the group (SIGCONT too, so a stopped member can act on it), wait up to
    ``timeout_s`` for every member to exit, then SIGKILL what is left and wait for that."""
    signal_group(pgid, sig)
    if sig is not signal.SIGKILL:
        signal_group(pgid, signal.SIGCONT)
        if wait_group_gone(pgid, timeout_s):
            return
    signal_group(pgid, signal.SIGKILL)
    wait_group_gone(pgid, 10.0)
