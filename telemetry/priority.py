"""CPU priority of slow-path processes: the lake writer runs on time the fast path leaves idle.

The writer (Arrow decode, zstd Parquet, fsync) shares its machine with vLLM engines whose OpenMP
threads meet at a barrier in every forward pass: a core taken from one of them for a few milliseconds
stalls the whole step, and every request in the batch waits for it. Nice values only weigh shares; a
waking nice-19 task may still preempt an engine thread. ``SCHED_IDLE`` does not: the kernel runs such
a task only where a core would otherwise idle, and never lets its wake-up preempt a normal task.

    CpuPriority.IDLE     SCHED_IDLE, plus nice 19 (shown by ps/top; the fallback where SCHED_IDLE
                         is unavailable)
    CpuPriority.NORMAL   leave the process as started

The price: while the fast path keeps every core busy, the writer falls behind. Its backlog is the
stream length, which the emitters bound (``stream_maxlen``); beyond it they drop and count
(``stream_full``). Telemetry can be lost under sustained saturation; latency is never spent on it.
Give the writer cores of its own (or its own pod) where that trade is wrong.

Policy and nice value are per thread on Linux: ``apply_cpu_priority`` lowers every thread the process
already has (imports such as pyarrow start some), and threads started later inherit it.
"""

from __future__ import annotations

import enum
import logging
import os

log = logging.getLogger(__name__)

LOWEST_NICE = 19


class CpuPriority(enum.StrEnum):
    IDLE = "idle"
    NORMAL = "normal"


def _thread_ids() -> list[int]:
    """Every thread of this process (Linux), else just the calling one (0)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def apply_cpu_priority(priority: CpuPriority) -> str:
    """Lower every thread of this process, and so every thread it starts later, to ``priority``.
    Returns what now applies, in words (for the log)."""
    if priority is CpuPriority.NORMAL:
        return "normal"
    sched_idle = getattr(os, "SCHED_IDLE", None)
    nice_ok = idle_ok = True
    for tid in _thread_ids():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST_NICE)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            nice_ok = False
            log.warning("cannot set nice %d on thread %d: %s", LOWEST_NICE, tid, exc)
        if sched_idle is None:
            idle_ok = False
            continue
        try:
            os.sched_setscheduler(tid, sched_idle, os.sched_param(0))
        except ProcessLookupError:
            continue
        except OSError as exc:
            idle_ok = False
            log.warning("cannot set SCHED_IDLE on thread %d: %s", tid, exc)
    applied = (["SCHED_IDLE"] if idle_ok else []) + ([f"nice {LOWEST_NICE}"] if nice_ok else [])
    return ", ".join(applied) or "normal (lowering failed)"
