"""CPU priority of the processes that share cores with engines: the lake writer runs on time the fast
path leaves idle; the router takes its turn instead of cutting into an engine's.

The writer (Arrow decode, zstd Parquet, fsync) shares its machine with vLLM engines whose OpenMP
threads meet at a barrier in every forward pass: a core taken from one of them for a few milliseconds
stalls the whole step, and every request in the batch waits for it. Nice values only weigh shares; a
waking nice-19 task may still preempt an engine thread. ``SCHED_IDLE`` does not: the kernel runs such
a task only where a core would otherwise idle, and never lets its wake-up preempt a normal task.

    CpuPriority.IDLE     SCHED_IDLE, plus nice 19 (shown by ps/top; the fallback where SCHED_IDLE
                         is unavailable)
    CpuPriority.BATCH    SCHED_BATCH, nice unchanged: its full share of CPU, but a wake-up never
                         preempts a running normal task; it runs at the next scheduling point (the
                         running task's slice ends, blocks or yields) or at once on an idle core
    CpuPriority.NORMAL   leave the process as started

The router is BATCH by default (``TANDEM_ROUTER_CPU_PRIORITY``, ``router.settings``): on a CPU host
it wakes for every token of every stream (one SSE chunk each), and each wake-up that preempts an
engine's OpenMP thread stalls that engine's step at its next barrier. As BATCH its wake-ups wait for
the slice to end (a few milliseconds at most), and the chunks that arrived meanwhile are relayed in
one turn; where a core idles, as on a GPU host, nothing waits at all.

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
    BATCH = "batch"
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
    if priority is CpuPriority.BATCH:
        return _apply_batch()
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


def _apply_batch() -> str:
    sched_batch = getattr(os, "SCHED_BATCH", None)
    if sched_batch is None:
        return "normal (no SCHED_BATCH here)"
    ok = True
    for tid in _thread_ids():
        try:
            os.sched_setscheduler(tid, sched_batch, os.sched_param(0))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            ok = False
            log.warning("cannot set SCHED_BATCH on thread %d: %s", tid, exc)
    return "SCHED_BATCH" if ok else "normal (SCHED_BATCH failed)"
