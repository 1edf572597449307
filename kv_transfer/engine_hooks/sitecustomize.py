"""Start-up hook of every Python process of a Tandem engine (the node puts this folder first on the
engine's PYTHONPATH; Python imports ``sitecustomize`` by itself at start-up). Two fixes for engines on
hosts with few cores, each a node setting.

**vLLM's step queues spin** (``TANDEM_ENGINE_SPIN_MS``, ``NodeSettings.engine_spin_ms``). The engine
core and its worker process hand each step over through shared-memory queues
(``vllm.distributed.device_communicators.shm_broadcast``) whose readers busy-wait with
``sched_yield`` for a second after every message before they sleep on a ZeroMQ notification. On a
GPU host that buys microseconds on an idle core. On a CPU node the spinner is the engine core waiting
for every step of its worker, on the node's own cores: beside the worker's OpenMP threads, and beside
the KV pull and send threads while a transfer runs (the decode engine's worker waits for its pull,
``pull_wait_ms``, and its engine core spins all that time). With the setting, a reader spins at most
that long, then sleeps until the writer's notification, which every write sends. Two more changes make
the sleep safe, since vLLM's spin had hidden a lost wake-up: its notification socket's high-water mark
of 1 drops a notification sent while the one before is still in ZeroMQ's pipe (its writer looks for
the pipe's drain at most once a millisecond), and a reader that slept through a dropped one woke at
vLLM's 5 s recheck. Measured (ad hoc, vLLM's MessageQueue between two processes, messages in pairs
0.2-0.7 ms apart, reader spin 0): 2 reads of 11,000 waited 5.02 s with vLLM's mark, none of 10,000
without it. So writers here have no high-water mark (the readers' sockets keep only the newest
notification anyway), and a sleeping reader looks again every ``RECHECK_MS``, so a wake-up lost any
other way costs that, not 5 s. The module is patched when it is first imported, so processes that
never import it pay nothing.

**NIXL's progress thread** (``TANDEM_NIXL_PROGRESS_THREAD``). NIXL's UCX progress thread busy-polls a
whole core for the life of the engine, even when idle (measured here: 5.0 s of CPU per 5 s). On a host
with few cores it steals the core the engine computes on, and OpenMP compute threads that lose their
core stall each other at every barrier. Turning the thread off is not safe (measured: transfers then
never complete, whatever UCX_TLS), so instead the threads NIXL starts when vLLM creates its agent are
moved to SCHED_IDLE: they still run whenever a core has nothing else to do (which is exactly when a
transfer is being waited for), and never take a core from compute.
``TANDEM_NIXL_PROGRESS_THREAD`` = ``idle`` (default) | ``normal`` (NIXL as shipped).

Both variables cross a process boundary (the node agent writes them, ``node_agent.node.engine_env``; every
engine process reads them here), so they stay in the environment, read once by ``HookSettings.from_env``:
the standard library only, since this runs at the start of every engine process before anything else.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

STEP_QUEUES = "vllm.distributed.device_communicators.shm_broadcast"
RECHECK_MS = 100
"""A sleeping step-queue reader looks again this often even without a notification (vLLM: 5 s)."""


SPIN_MS_ENV = "TANDEM_ENGINE_SPIN_MS"
NIXL_PROGRESS_ENV = "TANDEM_NIXL_PROGRESS_THREAD"


@dataclass(frozen=True, slots=True)
class HookSettings:
    """The hooks' two settings, as the node agent handed them to this engine process."""

    demote_nixl: bool = True
    """``TANDEM_NIXL_PROGRESS_THREAD`` is ``idle`` (its default): NIXL's threads go to SCHED_IDLE."""
    spin_ms: float | None = None
    """``TANDEM_ENGINE_SPIN_MS``: the step queues' longest spin; None (unset): vLLM's own."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> HookSettings:
        raw = env.get(SPIN_MS_ENV, "")
        return cls(demote_nixl=env.get(NIXL_PROGRESS_ENV, "idle") == "idle", spin_ms=float(raw) if raw else None)


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _demote_nixl_threads(settings: HookSettings) -> None:
    if not settings.demote_nixl:
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


SETTINGS = HookSettings.from_env()
_demote_nixl_threads(SETTINGS)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch`` on module ``name`` right after its first import, whoever imports it."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and so that the lookup below finds the real module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _cap_step_queue_spin(settings: HookSettings) -> None:
    if settings.spin_ms is None:
        return  # vLLM's own spin
    spin_s = settings.spin_ms / 1000

    def patch(module: ModuleType) -> None:
        import zmq

        cls = module.SpinCondition
        original = cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            original(self, *args, **kwargs)
            if self.is_reader:
                self.busy_loop_s = min(self.busy_loop_s, spin_s)
            else:  # the readers connect after this (the writer hands them its address): their pipes take it
                self.local_notify_socket.setsockopt(zmq.SNDHWM, 0)

        cls.__init__ = __init__
        module.SHM_READER_RECHECK_INTERVAL_MS = min(module.SHM_READER_RECHECK_INTERVAL_MS, RECHECK_MS)  # type: ignore[attr-defined]

    if STEP_QUEUES in sys.modules:
        patch(sys.modules[STEP_QUEUES])
    else:
        sys.meta_path.insert(0, _AfterImport(STEP_QUEUES, patch))


_cap_step_queue_spin(SETTINGS)
