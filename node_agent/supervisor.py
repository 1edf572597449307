"""The node agent's supervision of its engine: restart what dies or hangs, give up when it keeps failing.

One engine at a time, under one node id, each start a new *incarnation* with its own epoch
(``NodeRegistry.next_epoch``), so the router drops what an old engine held (KV index entries) even if
it never saw the id leave the registry.

                       ┌──────────────────────────── backoff elapsed ───────────────────────────┐
                       ▼                                                                        │
    ──▶ CHECK PORTS ──free──▶ STARTING ──/health 200──▶ SERVING ──exit / hung──▶ deregister ─┐  │
            │                   │                         │  every heartbeat_s: probe       │  │
            │ taken             │ exit, start timeout     │  /health + /metrics, write load  │  │
            ▼                   ▼                         │                                  ▼  │
       first start: PortInUse   └──────────── failure ◀───┴──────────────────────────── RESTARTING
       (exit 1, names holder);                 │           (stop the group; a hung one by SIGKILL)
       later: a failure                        │ ≥ max_failures within failure_window_s
                                               ▼
                                           UNHEALTHY: deregistered, status record says so, exit 3

    any state ── SIGTERM / SIGINT ──▶ deregister, [drain], stop the engine's group, STOPPED, exit 0

Failures. An engine *fails* when it exits while serving, exits or times out during start-up, or
*hangs*: ``health_failures`` probes in a row fail (a probe is GET /health plus GET /metrics, each
within ``health_timeout_s``), or it has requests running or waiting while its token counters stay
still for ``stall_timeout_s`` and it computes nothing (its process group uses under 0.2 of a core), or
for ``stall_compute_timeout_s`` whatever it computes (a long prefill step on a slow CPU moves no
counter until it ends; a spinning deadlock never does), or one of its processes is stopped (state T)
for ``stall_timeout_s``. vLLM's
API server answers /health as long as the engine core has not *died*, so a stopped or deadlocked core
is only visible through the last two. A core stopped while the engine is idle stays invisible until a
request arrives; that request then stalls and is caught.

Backoff. The n-th failure inside the window waits ``restart_backoff_s * 2**(n-1)``, capped at
``restart_backoff_max_s``: failures age out of the window, so a node that served for a while restarts
fast again. Reaching ``max_failures`` inside the window stops the loop (``EXIT_UNHEALTHY``): a node
that cannot keep an engine up reports it rather than churning; ``tandem up`` leaves such a node down.

Deregistration comes first on every failure, before the engine's group is stopped, so routers stop
sending to it as soon as they next read the registry rather than when its TTL lapses.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import msgspec

from contracts.errors import PortInUse, StoreError, UpstreamError
from contracts.registry import NodeInfo, NodeLoad, NodeRegistry, NodeState, NodeStatus
from node_agent.engine_metrics import EngineSnapshot, read_snapshot
from node_agent.lifetime import group_state
from node_agent.ports import check_ports_free
from node_agent.settings import NodeSettings

log = logging.getLogger("tandem.node.supervisor")

EXIT_UNHEALTHY = 3
"""Exit status of a node agent that gave up on its engine (``max_failures`` in the window)."""
COMPUTING_CORES = 0.2
"""CPU use (in cores) of the engine's process group above which it counts as computing."""


class Engine(Protocol):
    """One engine process (group); ``node_agent.node.EngineProcess`` for vLLM, a small stand-in in tests."""

    @property
    def pid(self) -> int | None: ...

    def start(self) -> None: ...

    def exited(self) -> int | None: ...

    def stop(self, timeout_s: float = 20.0) -> None: ...

    def kill(self) -> None: ...


Describe = Callable[[httpx.AsyncClient, int], Awaitable[NodeInfo]]
"""(client, epoch) -> the NodeInfo to register for the engine that just became healthy."""


class Ending(enum.Enum):
    STOP = "stop"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Outcome:
    ending: Ending
    reason: str = ""
    hung: bool = False


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


@dataclass
class _Watch:
    """What ``EngineSupervisor._serve`` remembers of one engine between its probes."""

    load: NodeLoad
    """The last load written (a failed probe repeats it, marked)."""
    progress: tuple[float, float]
    """(token counter, when it last moved or the engine was idle)."""
    computed_at: float = field(default_factory=time.monotonic)
    """When the engine's processes last used ``COMPUTING_CORES`` or more (or it waited on a pull)."""
    failed_probes: int = 0
    cpu_mark: tuple[float, float] | None = None
    """(group CPU seconds, when read)."""
    stopped_since: float | None = None
    """When one of its processes was first seen stopped (state T), while it stays so."""


class EngineSupervisor:
    """Runs engines for one node until stopped or unhealthy; see the module docstring."""

    def __init__(
        self,
        settings: NodeSettings,
        registry: NodeRegistry,
        new_engine: Callable[[], Engine],
        describe: Describe,
        *,
        on_healthy: Callable[[Engine], None] | None = None,
        on_ready: Callable[[NodeInfo], None] | None = None,
    ) -> None:
        """``on_healthy(engine)`` runs once an engine answers /health, before it is registered (the node
        pins its threads there); ``on_ready(info)`` after it is registered."""
        self.settings = settings
        self.registry = registry
        self._new_engine = new_engine
        self._describe = describe
        self._on_healthy = on_healthy
        self._on_ready = on_ready
        self.epoch = 0
        self.restarts = 0
        self.state = NodeState.STARTING
        self.last_exit: str | None = None
        self._failures: deque[float] = deque()
        self.engine: Engine | None = None

    # ---- the loop --------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Supervise until ``stop`` is set (returns 0) or the node is unhealthy (``EXIT_UNHEALTHY``).
        Raises ``PortInUse`` if a port is taken before the first start."""
        s = self.settings
        first = True
        # The engine's API key on every call (its /v1/models needs it; /health and /metrics do not).
        async with httpx.AsyncClient(headers=s.engine_headers()) as client:
            while not stop.is_set():
                try:
                    check_ports_free(s.host, s.engine_ports)
                except PortInUse as exc:
                    if first:
                        await self._set_status(NodeState.UNHEALTHY, last_exit=exc.message)
                        raise
                    outcome = Outcome(Ending.FAILED, exc.message)
                else:
                    outcome = await self._one_incarnation(client, stop)
                first = False
                if outcome.ending is Ending.STOP:
                    break
                delay = self._record_failure(outcome.reason)
                if delay is None:
                    log.error(
                        "node %s: %d engine failures within %.0f s (last: %s); giving up: unhealthy",
                        s.node_id,
                        len(self._failures),
                        s.failure_window_s,
                        outcome.reason,
                    )
                    await self._set_status(NodeState.UNHEALTHY)
                    return EXIT_UNHEALTHY
                log.warning(
                    "node %s: engine failed (%s); restart %d in %.1f s",
                    s.node_id,
                    outcome.reason,
                    self.restarts + 1,
                    delay,
                )
                print(f"RESTARTING node {s.node_id} in {delay:.1f}s: {outcome.reason}", flush=True)
                await self._set_status(NodeState.RESTARTING)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                if not stop.is_set():
                    self.restarts += 1
        await self._set_status(NodeState.STOPPED)
        return 0

    def _record_failure(self, reason: str) -> float | None:
        """Count a failure; the delay before the next start, or None when the node must give up."""
        s = self.settings
        now = time.monotonic()
        self.last_exit = reason
        self._failures.append(now)
        while self._failures and now - self._failures[0] > s.failure_window_s:
            self._failures.popleft()
        n = len(self._failures)
        if n >= s.max_failures:
            return None
        return min(s.restart_backoff_max_s, s.restart_backoff_s * 2 ** (n - 1))

    async def _one_incarnation(self, client: httpx.AsyncClient, stop: asyncio.Event) -> Outcome:
        s = self.settings
        self.epoch = await self._next_epoch()
        await self._set_status(NodeState.STARTING)
        engine = self._new_engine()
        self.engine = engine
        engine.start()
        registered = False
        outcome = Outcome(Ending.STOP)
        try:
            not_up = await self._wait_healthy(engine, client, stop)
            if not_up is not None:
                outcome = not_up
                return outcome
            if self._on_healthy is not None:
                self._on_healthy(engine)
            info = await self._describe(client, self.epoch)
            registered = True
            try:
                await self.registry.register(info)
            except StoreError as exc:
                # Redis is down (or restarting): registering is a heartbeat, and _serve keeps beating.
                log.warning("node %s: registration deferred to the next heartbeat: %s", s.node_id, exc)
            self.state = NodeState.SERVING
            await self._set_status(NodeState.SERVING)
            log.info("node %s (%s) ready at %s, epoch %d", info.node_id, info.role, info.url, info.epoch)
            print(f"READY node {info.node_id} role={info.role} url={info.url} epoch={info.epoch}", flush=True)
            if self._on_ready is not None:
                self._on_ready(info)
            outcome = await self._serve(engine, info, client, stop)
            return outcome
        except (UpstreamError, httpx.HTTPError, KeyError, ValueError) as exc:
            # describe() could not read the engine it just saw healthy: count it as a failed start.
            outcome = Outcome(Ending.FAILED, f"engine unreadable after start: {exc}")
            return outcome
        finally:
            if registered:
                # Routers stop sending before anything else happens to the engine.
                with contextlib.suppress(StoreError):
                    await self.registry.deregister(s.node_id)
                if outcome.ending is Ending.STOP and s.drain_timeout_s > 0:
                    await self._drain(engine, client)
            if outcome.hung:
                await asyncio.to_thread(engine.kill)
            else:
                await asyncio.to_thread(engine.stop)
            self.engine = None

    async def _drain(self, engine: Engine, client: httpx.AsyncClient) -> None:
        """Stopping, deregistered: let the engine finish what it runs and its leases end (decode nodes
        pull what it prefilled) before it is stopped, for at most ``drain_timeout_s``. An engine that
        stops answering or exits ends the wait."""
        s = self.settings
        deadline = time.monotonic() + s.drain_timeout_s
        while engine.exited() is None:
            try:
                snap = await asyncio.wait_for(read_snapshot(client, s.url), s.health_timeout_s)
            except (UpstreamError, TimeoutError):
                return
            if snap.running + snap.waiting + snap.leases_active == 0:
                log.info("node %s drained", s.node_id)
                return
            if time.monotonic() > deadline:
                log.warning(
                    "node %s: drain timed out after %.0f s with %d running, %d waiting, %d leases",
                    s.node_id,
                    s.drain_timeout_s,
                    snap.running,
                    snap.waiting,
                    snap.leases_active,
                )
                return
            # Polling a child that has no completion callback (the stop event is already set).
            await asyncio.sleep(0.2)

    async def _next_epoch(self) -> int:
        try:
            return max(self.epoch + 1, await self.registry.next_epoch(self.settings.node_id))
        except StoreError as exc:
            log.warning("epoch counter unavailable, counting locally: %s", exc)
            return self.epoch + 1

    async def _wait_healthy(self, engine: Engine, client: httpx.AsyncClient, stop: asyncio.Event) -> Outcome | None:
        """None once /health answers 200; an Outcome if the engine exits, start-up times out, or stop."""
        s = self.settings
        deadline = time.monotonic() + s.startup_timeout_s
        while not stop.is_set():
            code = engine.exited()
            if code is not None:
                return Outcome(Ending.FAILED, f"engine {describe_exit(code)} during start-up")
            if time.monotonic() > deadline:
                return Outcome(Ending.FAILED, f"engine not healthy after {s.startup_timeout_s:.0f} s", hung=True)
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{s.url}/health", timeout=2.0)).status_code == 200:
                    return None
            # Polling a child that has no readiness callback; wakes at once on stop.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        return Outcome(Ending.STOP)

    async def _serve(self, engine: Engine, info: NodeInfo, client: httpx.AsyncClient, stop: asyncio.Event) -> Outcome:
        """Heartbeat and probe until the engine exits, hangs, or stop: each heartbeat a probe
        (``_probe``, which also writes the load) and a look at the engine's processes
        (``_check_processes``)."""
        watch = _Watch(load=NodeLoad(updated_at=time.time()), progress=(-1.0, time.monotonic()))
        while not stop.is_set():
            code = engine.exited()
            if code is not None:
                log.error("node %s: engine %s", self.settings.node_id, describe_exit(code))
                return Outcome(Ending.FAILED, f"engine {describe_exit(code)}")
            now = time.monotonic()
            outcome = await self._probe(info, client, watch, now) or await self._check_processes(engine, watch, now)
            if outcome is not None:
                return outcome
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.heartbeat_s)
        return Outcome(Ending.STOP)

    async def _probe(self, info: NodeInfo, client: httpx.AsyncClient, watch: _Watch, now: float) -> Outcome | None:
        """GET /health and /metrics: a heartbeat with the engine's load, or a failed probe counted (a
        heartbeat with the last load, marked), or the hang found (probes failing in a row, or no token
        moving for too long)."""
        s = self.settings
        try:
            health = await client.get(f"{s.url}/health", timeout=s.health_timeout_s)
            if health.status_code != 200:
                raise UpstreamError(f"/health answered {health.status_code}")
            snap = await asyncio.wait_for(read_snapshot(client, s.url), s.health_timeout_s)
        except (httpx.HTTPError, UpstreamError, TimeoutError) as exc:
            watch.failed_probes += 1
            log.warning(
                "node %s: probe %d/%d failed: %s",
                s.node_id,
                watch.failed_probes,
                s.health_failures,
                exc or type(exc).__name__,
            )
            if watch.failed_probes >= s.health_failures:
                return Outcome(Ending.FAILED, f"hung: {watch.failed_probes} probes in a row failed", hung=True)
            # Not hung yet: keep the entry alive (the last load, marked with the failures), so one
            # slow probe of a busy engine does not cost the node its place in the fleet index;
            # routers leave a node with failed probes out of routing until a probe answers again.
            await self._beat(info, msgspec.structs.replace(watch.load, failed_probes=watch.failed_probes))
            return None
        watch.failed_probes = 0
        stalled = self._stalled(snap, watch, now)
        if stalled is not None:
            return stalled
        watch.load = NodeLoad(
            running=snap.running, waiting=snap.waiting, kv_usage=snap.kv_usage, updated_at=time.time()
        )
        await self._beat(info, watch.load)
        return None

    def _stalled(self, snap: EngineSnapshot, watch: _Watch, now: float) -> Outcome | None:
        """The hang of an engine with requests whose token counters stay still: for ``stall_timeout_s``
        while it computes nothing, for ``stall_compute_timeout_s`` whatever it computes."""
        s = self.settings
        if snap.pulls_active:
            # Waiting for a pull is waiting on a peer, not a hang: a layer-wise pull lasts as long
            # as the prefill node computes the prompt (minutes for a long one on a slow CPU) and
            # fails by itself once that node goes quiet (the connector's stall timeout). It gets
            # the computing engine's limit, not the idle one's.
            watch.computed_at = now
        tokens = snap.generation_tokens + sum(snap.prompt_tokens_by_source.values())
        busy = snap.running + snap.waiting > 0
        still = now - watch.progress[1]
        if not busy or tokens != watch.progress[0]:
            watch.progress = (tokens, now)
        elif still > s.stall_compute_timeout_s or (
            still > s.stall_timeout_s and now - watch.computed_at > s.stall_timeout_s
        ):
            doing = "idle CPU"
            if now - watch.computed_at <= s.stall_timeout_s:
                doing = "pulling KV" if snap.pulls_active else "computing"
            return Outcome(
                Ending.FAILED,
                f"hung: {snap.running} running, {snap.waiting} waiting and no token for {still:.0f} s ({doing})",
                hung=True,
            )
        return None

    async def _check_processes(self, engine: Engine, watch: _Watch, now: float) -> Outcome | None:
        """The engine's process group: whether it computes (``COMPUTING_CORES`` or more since the last
        look), and the hang of a process stopped (state T) for ``stall_timeout_s``."""
        pid = engine.pid
        stopped, cpu = await asyncio.to_thread(group_state, pid) if pid is not None else ([], 0.0)
        if (
            watch.cpu_mark is not None
            and now > watch.cpu_mark[1]
            and (cpu - watch.cpu_mark[0]) / (now - watch.cpu_mark[1]) >= COMPUTING_CORES
        ):
            watch.computed_at = now
        watch.cpu_mark = (cpu, now)
        if stopped:
            watch.stopped_since = watch.stopped_since or now
            if now - watch.stopped_since > self.settings.stall_timeout_s:
                return Outcome(
                    Ending.FAILED, f"hung: engine process stopped for {now - watch.stopped_since:.0f} s", hung=True
                )
        else:
            watch.stopped_since = None
        return None

    async def _beat(self, info: NodeInfo, load: NodeLoad) -> None:
        try:
            await self.registry.heartbeat(info, load)
        except StoreError as exc:
            # A missed beat is not fatal: the TTL covers a few; a dead engine is caught by the probes.
            log.warning("heartbeat skipped: %s", exc)

    async def _set_status(self, state: NodeState, *, last_exit: str | None = None) -> None:
        self.state = state
        status = NodeStatus(
            node_id=self.settings.node_id,
            state=state,
            epoch=self.epoch,
            restarts=self.restarts,
            last_exit=last_exit or self.last_exit,
            updated_at=time.time(),
        )
        try:
            await self.registry.set_status(status)
        except StoreError as exc:
            log.warning("status record not written: %s", exc)


__all__ = ["EXIT_UNHEALTHY", "Engine", "EngineSupervisor", "describe_exit"]
