"""The router's view of the fleet: live nodes from the registry, plus its own in-flight counts.

The registry is re-read every ``refresh_s``, as a job of the router's one periodic loop
(``router.housekeeping``; a fleet given none runs a loop of its own); a node whose heartbeat lapsed disappears
from the next read, so it leaves routing within one registry TTL plus one refresh. If Redis is briefly
unreachable the last good view is kept (a router that cannot see the registry still serves).

Catching up. A request for a model no node in the view serves waits for a registry read that started
after it arrived before it is refused (``catch_up``): a node that registered since the last read (one
that just started, or seen by another replica of the router first) serves its first request at once,
from every replica, not after a refresh period. Reads are single-flight (a periodic and a catching-up
read never overlap; callers join the one under way) and start at most once per ``catch_up_s``, so a
flood of requests for unknown models costs at most one registry read per ``catch_up_s`` (and each such
request waits at most that long plus one read for its 404).

Failures. A leg that cannot reach its node (refused, reset, timed out: ``UpstreamError`` that is no
engine answer) marks the node down at once (``mark_down``): it leaves routing for ``down_s`` without
waiting for its registry entry to lapse, and comes back when that passes (the next request probes it)
or when the registry shows a new incarnation. A node whose agent reports failed probes of its engine
(``NodeLoad.failed_probes``: a stopped or overloaded engine, not yet counted as hung) is left out the
same way until a probe answers. If every node of a model is down, all are offered again: trying beats
refusing.

Incarnations. A node id keeps its name across engine restarts (the node agent restarts a dead or hung
engine; ``tandem up`` restarts a dead agent) but every engine start registers a new ``epoch``. Nothing
an old incarnation held survives it: its KV blocks are dropped from the fleet index by the refresh
hook (``KVEventSubscribers.sync`` treats a new epoch as a new node), and the fleet counts the restart
(``restarts``) and logs it. Requests still in flight on the old engine end on their own (they fail
and release their slot), so in-flight counts are left to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import msgspec
import zmq

from contracts.errors import ModelNotFound, NotFound, StoreError, TandemError, Unavailable
from contracts.registry import LiveNode, NodeRegistry, Role
from router.housekeeping import Housekeeping
from router.policies.base import Candidate

log = logging.getLogger("tandem.router.fleet")


@dataclass(frozen=True, slots=True)
class Pools:
    prefill: list[Candidate]
    decode: list[Candidate]
    colocated: list[Candidate]


_ENDED_KEPT = 16
"""Ends of a node's requests a router remembers (``Fleet.ended_since``): a heartbeat's worth and more."""


class Fleet:
    def __init__(
        self,
        registry: NodeRegistry,
        *,
        refresh_s: float = 0.5,
        on_refresh: Callable[[list[LiveNode]], Awaitable[None]] | None = None,
        down_s: float = 5.0,
        catch_up_s: float = 0.1,
    ) -> None:
        self._registry = registry
        self._catch_up_s = catch_up_s
        self._reading: asyncio.Future[None] | None = None
        """The registry read under way, which every caller of ``refresh`` joins."""
        self._read_started = -float("inf")
        """monotonic time the last (or current) read started."""
        self._down_s = down_s
        self._down: dict[str, float] = {}
        """node id -> monotonic time until which it is left out of routing."""
        self._on_refresh = on_refresh
        self._refresh_s = refresh_s
        self._nodes: list[LiveNode] = []
        self.model_names: frozenset[str] = frozenset()
        """The models the nodes of the last registry read serve (a bounded set: safe as metric labels)."""
        self._inflight: Counter[str] = Counter()
        self._ended: dict[str, deque[float]] = {}
        """node id -> when this router's last few requests there ended (wall clock, as heartbeats are)."""
        self._epochs: dict[str, int] = {}
        self.restarts: Counter[str] = Counter()
        """Incarnation changes seen per node id since this router started."""
        self._own_loop: Housekeeping | None = None

    async def start(self, housekeeping: Housekeeping | None = None) -> None:
        """Read the registry now, then every ``refresh_s`` as a job of ``housekeeping`` (or of a loop
        of the fleet's own when none is given)."""
        await self.refresh()
        if housekeeping is None:
            housekeeping = self._own_loop = Housekeeping(tick_s=self._refresh_s)
            housekeeping.start()
        housekeeping.every(self._refresh_s, self._refresh_round, name="fleet-refresh")

    async def stop(self) -> None:
        if self._own_loop is not None:
            await self._own_loop.stop()

    async def refresh(self) -> None:
        """Read the registry (or join the read under way) and update the view."""
        if self._reading is None:
            self._read_started = time.monotonic()
            self._reading = reading = asyncio.ensure_future(self._read())
            reading.add_done_callback(self._read_done)
        # Shielded: a caller that leaves (a client gone) leaves the read to finish for the others.
        await asyncio.shield(self._reading)

    async def catch_up(self) -> None:
        """Return once a registry read that started after this call has ended (see the module's
        docstring): for a request whose model no node in the view serves."""
        asked = time.monotonic()
        while self._read_started < asked:
            if self._reading is None and (wait := self._read_started + self._catch_up_s - time.monotonic()) > 0:
                await asyncio.sleep(wait)  # the rate limit: at most one read per catch_up_s
                continue
            await self._refresh_round()  # starts a read, or joins (and then outlives) an older one
        if self._reading is not None:
            await self._refresh_round()  # the read that started after the call is still under way

    def _read_done(self, reading: asyncio.Future[None]) -> None:
        self._reading = None
        if not reading.cancelled():
            reading.exception()  # retrieved here too: every caller may have left

    async def _read(self) -> None:
        try:
            self._nodes = await self._registry.live_nodes()
            self.model_names = frozenset(n.info.model for n in self._nodes)
        except StoreError as exc:
            log.warning("registry unreadable, keeping last view: %s", exc)
            return
        self._note_epochs(self._nodes)
        if self._on_refresh is not None:
            try:
                await self._on_refresh(self._nodes)
            except (TandemError, OSError, zmq.ZMQError) as exc:
                # The KV index follows the fleet on a best-effort basis; routing must go on without it.
                log.warning("fleet refresh hook failed: %s", exc)

    def _note_epochs(self, nodes: list[LiveNode]) -> None:
        for n in nodes:
            node_id, epoch = n.info.node_id, n.info.epoch
            last = self._epochs.get(node_id)
            if last is not None and epoch != last:
                self.restarts[node_id] += 1
                self._down.pop(node_id, None)  # a new engine: worth trying at once
                log.warning(
                    "node %s is a new incarnation (epoch %d -> %d): dropping what the old one held",
                    node_id,
                    last,
                    epoch,
                )
            self._epochs[node_id] = epoch

    def epoch(self, node_id: str) -> int | None:
        """The epoch of ``node_id`` as last seen in the registry (kept while it is away)."""
        return self._epochs.get(node_id)

    async def _refresh_round(self) -> None:
        try:
            await self.refresh()
        except (TandemError, msgspec.MsgspecError, ValueError, OSError) as exc:
            # Whatever one refresh meets, the next one runs: a stale view routes. (Bad registry entries
            # are skipped by the registry itself.)
            log.error("fleet refresh failed, keeping last view: %s", exc)

    @property
    def skipped_entries(self) -> dict[str, int]:
        """Registry entries left out of the view since start, by reason (``contracts.registry``)."""
        return dict(self._registry.skipped)

    @property
    def nodes(self) -> list[LiveNode]:
        return list(self._nodes)

    def models(self) -> dict[str, LiveNode]:
        """One representative node per served model."""
        out: dict[str, LiveNode] = {}
        for n in self._nodes:
            out.setdefault(n.info.model, n)
        return out

    def serves(self, model: str) -> bool:
        """Whether a live node of ``model`` is in routing now (not marked down): a fallback model is
        chosen when this is false (``router.model_table``)."""
        return any(n.info.model == model and not self.is_down(n.info.node_id) for n in self._nodes)

    def mark_down(self, node_id: str, reason: str) -> None:
        """Leave ``node_id`` out of routing for ``down_s``: a leg could not reach it."""
        if node_id not in self._down:
            log.warning("node %s marked down for %.0f s: %s", node_id, self._down_s, reason)
        self._down[node_id] = time.monotonic() + self._down_s

    def is_down(self, node_id: str) -> bool:
        until = self._down.get(node_id)
        if until is None:
            return False
        if time.monotonic() >= until:
            del self._down[node_id]  # probed back in by the next request
            return False
        return True

    def _in_routing(self, node: LiveNode) -> bool:
        """Neither marked down by a failed leg nor reported failing its probes by its agent."""
        return not node.load.failed_probes and not self.is_down(node.info.node_id)

    def pools(self, model: str, *, exclude: frozenset[str] = frozenset()) -> Pools:
        nodes = [n for n in self._nodes if n.info.model == model]
        if not nodes:
            raise ModelNotFound(f"The model `{model}` does not exist or no node serves it.", param="model")
        allowed = [n for n in nodes if n.info.node_id not in exclude]
        up = [n for n in allowed if self._in_routing(n)]
        if len(up) < len(nodes):
            # Out of routing only while the rest can still serve the model: a P/D fleet whose only
            # prefill (or decode) node missed a probe keeps it, trying beats refusing.
            nodes = next((ns for ns in (up, allowed) if _can_serve(ns)), up or allowed or nodes)

        def cands(role: Role) -> list[Candidate]:
            return [Candidate(node=n, inflight=self._inflight[n.info.node_id]) for n in nodes if n.info.role is role]

        return Pools(prefill=cands(Role.PREFILL), decode=cands(Role.DECODE), colocated=cands(Role.BOTH))

    def pinned(self, model: str, node_id: str, *, param: str, retry_after: float = 1.0) -> Candidate:
        """The node an operator pinned a request to (``x-tandem-node``): 404 when no node of that id
        serves ``model``, 503 while it is out of routing (marked down, or failing its probes). Unlike
        ``pools``, never another node: a pinned request measures or debugs that node."""
        node = next((n for n in self._nodes if n.info.node_id == node_id and n.info.model == model), None)
        if node is None:
            raise NotFound(f"no live node `{node_id}` serves the model `{model}`", param=param, code="node_not_found")
        if not self._in_routing(node):
            raise Unavailable(
                f"node `{node_id}` is out of routing now (a failed leg or failing probes)",
                retry_after=retry_after,
                code="node_unavailable",
                param=param,
            )
        return Candidate(node=node, inflight=self._inflight[node_id])

    @contextlib.contextmanager
    def track(self, *candidates: Candidate | None) -> Iterator[None]:
        """Count a request as in flight on each given node for the duration of the block."""
        ids = [c.node_id for c in candidates if c is not None]
        for i in ids:
            self._inflight[i] += 1
        try:
            yield
        finally:
            now = time.time()
            for i in ids:
                self._inflight[i] -= 1
                if self._inflight[i] <= 0:
                    del self._inflight[i]
                self._ended.setdefault(i, deque(maxlen=_ENDED_KEPT)).append(now)

    def role_and_usage(self, node_id: str) -> tuple[str, float] | None:
        for n in self._nodes:
            if n.info.node_id == node_id:
                return n.info.role.value, n.load.kv_usage
        return None

    def inflight(self, node_id: str) -> int:
        return self._inflight[node_id]

    def ended_since(self, node_id: str, t: float) -> int:
        """How many of this router's requests on ``node_id`` ended after ``t`` (of the last few): work a
        heartbeat taken at ``t`` may have counted that is over now."""
        return sum(1 for e in self._ended.get(node_id, ()) if e > t)


def _can_serve(nodes: list[LiveNode]) -> bool:
    """Whether these nodes can answer a request: a colocated node, or a prefill and a decode node."""
    roles = {n.info.role for n in nodes}
    return Role.BOTH in roles or {Role.PREFILL, Role.DECODE} <= roles
