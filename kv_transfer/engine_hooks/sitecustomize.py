"""Start-up hook of every Python process of a Tandem engine (the node puts this folder first on the
engine's PYTHONPATH; Python imports ``sitecustomize`` by itself at start-up).

NIXL's UCX progress thread busy-polls a whole core for the life of the engine, even when idle (measured
here: 5.0 s of CPU per 5 s). On a host with few cores it steals the core the engine computes on, and
OpenMP compute threads that lose their core stall each other at every barrier. Turning the thread off
is not safe (measured: transfers then never complete, whatever UCX_TLS), so instead the threads
NIXL starts when vLLM creates its agent are moved to SCHED_IDLE: they still run whenever a core has
nothing else to do (which is exactly when a transfer is being waited for), and never take a core from
compute. ``TANDEM_NIXL_PROGRESS_THREAD`` = ``idle`` (default) | ``normal`` (NIXL as shipped).
"""

import os
from typing import Any


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _demote_nixl_threads() -> None:
    if os.environ.get("TANDEM_NIXL_PROGRESS_THREAD", "idle") != "idle":
        return
    try:
        import nixl_cu12._api as api  # what vLLM's nixl_utils resolves `nixl._api` to on this host
    except ImportError:
        return
    original = api.nixl_agent.__init__
    if getattr(original, "_tandem_patched", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        before = _threads()
        original(self, *args, **kwargs)
        for tid in _threads() - before:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                pass  # the thread already ended, or the platform refuses: NIXL runs as shipped

    __init__._tandem_patched = True  # type: ignore[attr-defined]
    api.nixl_agent.__init__ = __init__  # type: ignore[method-assign]


_demote_nixl_threads()
