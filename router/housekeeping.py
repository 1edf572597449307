"""The router's periodic work, done in one wake-up per tick (``DEFAULT_TICK_S``).

A router that serves nothing should cost nothing: on a CPU host every wake-up of any process is CPU
taken from the engines, and ``tandem bench overhead`` counts a router's idle CPU in every request's
share. Each periodic loop of its own (the fleet refresh, uvicorn's Date-header tick, the KV activity
interval) was a separate timer, a separate wake-up of a cold process, which on this 2-core host cost
about 0.4 ms of CPU each, whatever little work it then did. Here they are jobs of one loop: one timer,
one wake-up, every job whose period has come runs in it, in the order added.

The tick is 2 s, the nodes' heartbeat period: a fleet view re-read more often holds no fresher loads,
and the HTTP Date header (whole seconds) stays within what RFC 9110 allows as the time's best
approximation. Each tick costs a wake-up and, with the fleet refresh, a Redis round trip: an idle
router over one registered node took 1.07-1.14 ms of CPU a second at a 1 s tick, 0.62-0.63 at 2 s and
0.36-0.39 at 5 s (``python -m bench.relay_cpu --interval-ms 5 --rounds 1 --tokens 1 --streams 4
--idle-s 20`` with the tick and ``TANDEM_ROUTER_REGISTRY_REFRESH_S`` set alike, each twice, alternated;
2-core AMD EPYC). A router asked to refresh faster (``registry_refresh_s``) ticks that often.

A job is a plain or async callable. One that raises is logged and runs again at its next turn: no
periodic duty dies of one bad round. Jobs run one after another, so one that waits (a slow Redis) only
delays the others; each that talks to a store bounds its own wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("tandem.router.housekeeping")

DEFAULT_TICK_S = 2.0

Job = Callable[[], Awaitable[object] | object]


@dataclass(slots=True)
class _Entry:
    name: str
    period_s: float
    job: Job
    due: float


class Housekeeping:
    def __init__(self, tick_s: float = DEFAULT_TICK_S) -> None:
        self.tick_s = tick_s
        """The wake-up period; a job's period is rounded up to a whole number of ticks."""
        self._jobs: list[_Entry] = []
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0
        """Wake-ups so far (tests and ``/metrics`` can tell the loop is alive)."""

    def every(self, period_s: float, job: Job, *, name: str) -> None:
        """Run ``job`` every ``period_s`` (at most once a tick), first at the next tick."""
        if period_s <= 0:
            raise ValueError(f"period of {name} must be positive, not {period_s}")
        self._jobs.append(_Entry(name, period_s, job, due=0.0))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="housekeeping")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def run_due(self) -> None:
        """One round: every job whose time has come."""
        self.rounds += 1
        now = time.monotonic()
        for entry in self._jobs:
            if now < entry.due:
                continue
            # Next turn from now, less half a tick: a job of the tick's own period runs every tick
            # even when a round starts a little early.
            entry.due = now + entry.period_s - self.tick_s / 2
            try:
                result = entry.job()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - a periodic duty must survive any one round
                log.exception("housekeeping job %s failed; it runs again at its next turn", entry.name)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)  # the one periodic wake-up, not synchronisation
            await self.run_due()
