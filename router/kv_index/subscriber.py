"""Subscribers to the engines' KV events: one asyncio ZeroMQ SUB client per node, and a manager that
starts and stops them as nodes join and leave the registry.

Wire format (vLLM 0.32 ``ZmqEventPublisher``, see ``router.kv_index.events``): PUB multipart
``[topic, seq (8 bytes, big-endian), msgpack batch]``, ``seq`` counting from 0 per engine start; a
ROUTER replay endpoint answers ``[b"", start_seq]`` from a DEALER with every buffered batch from
``start_seq`` on, then an end marker (seq -1).

Sequence handling, per node (``expected`` = the next seq to apply):
  * at start, replay from 0: the node's history, as far as its buffer (``buffer_steps``) reaches;
  * ``seq == expected``: apply;
  * ``seq > expected`` (PUB dropped messages, or we joined late): replay from ``expected``;
  * ``seq < expected`` and inside the range the last replay covered: a live copy of a replayed batch,
    skipped; otherwise the engine restarted (a new publisher counts from 0): forget the node's blocks
    and replay from 0.
  * Events that cannot be recovered (no replay endpoint, replay timed out, the buffer no longer holds
    the range, an undecodable batch): the node's blocks are forgotten (``clear_node``) and rebuilt
    from the events that follow. Dropping hits is safe; keeping blocks whose BlockRemoved we lost
    would send requests to a node for a prefix it no longer holds.
  * A replay whose first batch starts with ``AllBlocksCleared`` is a snapshot (what a host tier answers,
    ``host_tier.events``): it replaces the node's blocks whole, so it recovers any range, whatever
    seq it carries.
A restart is also visible in the registry (``NodeInfo.epoch``, a new one per engine start under the
same node id, and ``started_at``): the manager then drops the node's blocks and starts a fresh
subscriber. This covers a new engine whose seq has already passed the old one's, and a new engine
that has published nothing yet (an empty cache is silent: without the epoch the old engine's blocks
would stay in the index, predicting hits the new engine cannot deliver).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from contracts.registry import LiveNode, NodeInfo
from router.kv_index.block_keys import BlockHasher, external_key
from router.kv_index.events import REPLAY_END_SEQ, AllBlocksCleared, BlockStored, KVEvent, decode_batch
from router.kv_index.index import FleetIndex, ModelIndex

log = logging.getLogger(__name__)

EventObserver = Callable[[str, KVEvent], None]
"""Called for every applied event with the node id (telemetry aggregates them); must not block."""


@dataclass(slots=True)
class SubscriberStats:
    live_batches: int = 0
    """Batches received on the PUB stream (applied or not)."""
    applied_batches: int = 0
    events: int = 0
    gaps: int = 0
    """Times a seq jumped ahead of the next expected one."""
    replays: int = 0
    replayed_batches: int = 0
    duplicates: int = 0
    restarts: int = 0
    lost: int = 0
    """Times events were unrecoverable and the node's blocks were forgotten."""
    decode_errors: int = 0
    skipped_events: int = 0
    """Events of a type this router does not know."""
    key_mismatches: int = 0
    """First blocks whose engine key differs from ours: the node's hash algo or seed is not the router's."""
    socket_errors: int = 0


@dataclass(frozen=True, slots=True)
class CurveClient:
    """CURVE keys (z85) for a node whose endpoints are its relay (``NodeInfo.kv_events_auth == "curve"``;
    ``contracts.secret.curve_keys`` derives them from the cluster secret)."""

    server_public: bytes
    public: bytes
    secret: bytes


class KVEventSubscriber:
    """Keeps one node's blocks in ``index`` current from its KV events."""

    def __init__(
        self,
        index: ModelIndex,
        node_id: str,
        events_endpoint: str,
        replay_endpoint: str | None = None,
        *,
        ctx: zmq.asyncio.Context,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        retry_delay_s: float = 1.0,
        hasher: BlockHasher | None = None,
        on_event: EventObserver | None = None,
        curve: CurveClient | None = None,
    ) -> None:
        """``curve``: the node's endpoints are its CURVE relay (``NodeInfo.kv_events_auth``)."""
        self.index = index
        self.on_event = on_event
        self.curve = curve
        self.node_id = node_id
        self.events_endpoint = events_endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.retry_delay_s = retry_delay_s
        self.hasher = hasher
        self.stats = SubscriberStats()
        self.expected: int | None = None
        self._ctx = ctx
        self._window: tuple[int, int] | None = None  # seqs the last replay applied
        self._task: asyncio.Task[None] | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None

    # --- life cycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.node_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None

    async def _run(self) -> None:
        while True:
            try:
                await self._serve()
            except zmq.ZMQError as exc:
                # Sockets reconnect by themselves; an error here means the socket itself is unusable.
                self.stats.socket_errors += 1
                log.warning("KV events of node %s: %s; resubscribing", self.node_id, exc)
                self._close_sockets()
                self._lost("socket error")
                self.expected, self._window = None, None
                await asyncio.sleep(self.retry_delay_s)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        if self.curve is not None:
            sock.curve_serverkey = self.curve.server_public
            sock.curve_publickey = self.curve.public
            sock.curve_secretkey = self.curve.secret
        return sock

    async def _serve(self) -> None:
        self._sub = self._socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.events_endpoint)
        if self.replay_endpoint is not None:
            await self._catch_up(0)
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3:
                self.stats.decode_errors += 1
                continue
            self.stats.live_batches += 1
            await self._on_live(int.from_bytes(frames[1], "big"), frames[2])

    # --- sequence logic -------------------------------------------------------------------------
    async def _on_live(self, seq: int, payload: bytes) -> None:
        if self.expected is None:
            self.expected = 0 if self.replay_endpoint is not None else seq
        if seq == self.expected:
            self._apply(seq, payload)
            if self._window is not None and seq > self._window[1]:
                self._window = None
            return
        if seq < self.expected:
            if self._window is not None and self._window[0] <= seq <= self._window[1]:
                self.stats.duplicates += 1
                return
            self.stats.restarts += 1
            log.info("node %s restarted its KV events (seq %d after %d)", self.node_id, seq, self.expected - 1)
            self.index.clear_node(self.node_id)
            self.expected, self._window = 0, None
            if seq == 0:
                self._apply(seq, payload)
                return
        # seq is ahead of the next one we need
        self.stats.gaps += 1
        recovered = self.replay_endpoint is not None and await self._catch_up(self.expected)
        if seq < self.expected:
            return  # the replay covered it
        if seq > self.expected and recovered:
            self._lost(f"seq {self.expected}..{seq - 1} missing from the replay")
        elif not recovered:
            self._lost(f"seq {self.expected}..{seq - 1} not recoverable")
        self._apply(seq, payload)

    async def _catch_up(self, start: int) -> bool:
        """Replay from ``start`` and apply what comes back, in order. False if the range from
        ``start`` could not be had (the node's blocks are then forgotten)."""
        self.stats.replays += 1
        batches = await self._request_replay(start)
        if batches is None:
            if self.expected is not None:
                self._lost(f"replay from {start} failed")
            return False
        if not batches:
            return True
        first = batches[0][0]
        snapshot = _is_snapshot(batches[0][1])
        ok = first == start or snapshot
        if not ok:
            self._lost(f"replay buffer starts at seq {first}, needed {start}")
        for seq, payload in batches:
            self._apply(seq, payload)
            self.stats.replayed_batches += 1
        # A snapshot stands for every batch up to its seq: live copies of those still queued on the SUB
        # socket are duplicates, not a restart.
        self._window = (min(start, first) if snapshot else first, batches[-1][0])
        return ok

    async def _request_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        if self._dealer is None:
            self._dealer = self._socket(zmq.DEALER)
            self._dealer.connect(self.replay_endpoint)  # type: ignore[arg-type]
        dealer = self._dealer
        await dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.replay_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await dealer.poll(timeout=left * 1000):
                # A late answer would be read as the next replay's: start that one on a fresh socket.
                log.warning("replay from %d timed out on node %s", start, self.node_id)
                dealer.close(linger=0)
                self._dealer = None
                return None
            frames = await dealer.recv_multipart()
            if len(frames) != 4:
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == REPLAY_END_SEQ:
                return out
            out.append((seq, frames[3]))

    def _apply(self, seq: int, payload: bytes) -> None:
        self.expected = seq + 1
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError:
            self.stats.decode_errors += 1
            self._lost(f"undecodable batch {seq}")
            return
        self.stats.applied_batches += 1
        self.stats.events += len(batch.events)
        self.stats.skipped_events += batch.skipped
        for ev in batch.events:
            if self.hasher is not None and isinstance(ev, BlockStored):
                self._check_keys(ev)
            self.index.apply(self.node_id, ev)
            if self.on_event is not None:
                self.on_event(self.node_id, ev)

    def _check_keys(self, ev: BlockStored) -> None:
        hasher = self.hasher
        if (
            hasher is None
            or ev.parent_block_hash is not None
            or not ev.block_hashes
            or ev.block_size != hasher.block_size
            or (ev.extra_keys and ev.extra_keys[0] is not None)
        ):
            return
        if not hasher.first_block_matches(ev.token_ids, external_key(ev.block_hashes[0])):
            self.stats.key_mismatches += 1
            if self.stats.key_mismatches == 1:
                log.error(
                    "node %s hashes blocks differently from the router (router: %s, seed %r): "
                    "check --prefix-caching-hash-algo and PYTHONHASHSEED",
                    self.node_id,
                    hasher.algo,
                    hasher.seed,
                )

    def _lost(self, why: str) -> None:
        self.stats.lost += 1
        log.warning("KV events of node %s lost (%s): forgetting its blocks", self.node_id, why)
        self.index.clear_node(self.node_id, cause="events_lost")


def _is_snapshot(payload: bytes) -> bool:
    try:
        events = decode_batch(payload).events
    except msgspec.DecodeError:
        return False
    return bool(events) and isinstance(events[0], AllBlocksCleared)


@functools.cache
def _local_addresses() -> frozenset[str]:
    import psutil

    addrs = {a.address for nics in psutil.net_if_addrs().values() for a in nics}
    return frozenset(addrs | {"localhost", socket.gethostname()})


def _on_this_host(host: str | None) -> bool:
    if not host:
        return False
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    return host in _local_addresses()


def tier_id(info: NodeInfo) -> str | None:
    """The id under which the index holds the blocks of the node's host tier (None: no tier, or none this
    router can hear). Nodes that name the same events endpoint on the same host share the tier. A tier's
    endpoints are host-local (ipc or loopback), so only a node on the router's own host counts: the same
    path on this host would be this host's tier, and crediting its blocks to another host's node would
    route there for hits it cannot deliver."""
    host = urlsplit(info.url).hostname
    if not info.host_tier_events_endpoint or not _on_this_host(host):
        return None
    return f"tier@{host}:{info.host_tier_events_endpoint}"


def _identity(info: NodeInfo) -> tuple[object, ...]:
    return (
        info.model,
        info.block_size,
        info.kv_events_endpoint,
        info.kv_replay_endpoint,
        info.kv_events_auth,
        info.started_at,
        info.epoch,
    )


class KVEventSubscribers:
    """One subscriber per live node that publishes KV events; call ``sync`` with the registry's live
    nodes whenever the router refreshes them, ``close`` at shutdown."""

    def __init__(
        self,
        index: FleetIndex,
        *,
        ctx: zmq.asyncio.Context | None = None,
        hashers: dict[str, BlockHasher] | None = None,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        on_event: EventObserver | None = None,
        curve_client: Callable[[], CurveClient] | None = None,
    ) -> None:
        """``curve_client``: the keys for nodes that relay their events with CURVE (called once, when
        the first such node appears)."""
        self.index = index
        self._on_event = on_event
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._hashers = hashers or {}
        self._topic = topic
        self._replay_timeout_s = replay_timeout_s
        self._subs: dict[str, tuple[tuple[object, ...], KVEventSubscriber]] = {}
        self._curve_client = curve_client
        self._curve_keys: CurveClient | None = None

    async def sync(self, nodes: Iterable[LiveNode]) -> None:
        """Start subscribers for new nodes; stop them and drop the blocks of nodes that left, and of
        nodes that restarted or moved (different ``epoch``, ``started_at`` or endpoints). The same for
        the nodes' host tiers (one subscriber per tier, however many nodes share it), and attach each
        node to its tier in the index."""
        infos = [n.info for n in nodes]
        wanted = {info.node_id: (_identity(info), info) for info in infos if info.kv_events_endpoint}
        for info in infos:
            tier = tier_id(info)
            if tier is not None and tier not in wanted:
                ident = ("tier", info.model, info.block_size, info.host_tier_events_endpoint)
                wanted[tier] = (ident, info)
        for node_id, (ident, sub) in list(self._subs.items()):
            want = wanted.get(node_id)
            if want is None or want[0] != ident:
                del self._subs[node_id]
                await sub.stop()
                self.index.drop_node(node_id)
        for node_id, (ident, info) in wanted.items():
            if node_id in self._subs:
                continue
            index = self.index.model(info.model, info.block_size)
            is_tier = ident[0] == "tier"
            if is_tier:
                index.add_tier(node_id)
            sub = KVEventSubscriber(
                index,
                node_id,
                (info.host_tier_events_endpoint if is_tier else info.kv_events_endpoint),  # type: ignore[arg-type]
                info.host_tier_replay_endpoint if is_tier else info.kv_replay_endpoint,
                ctx=self._ctx,
                topic="" if is_tier else self._topic,
                replay_timeout_s=self._replay_timeout_s,
                # a tier's events carry no tokens to check keys against
                hasher=None if is_tier else self._hashers.get(info.model),
                on_event=self._on_event,
                curve=self._curve() if info.kv_events_auth == "curve" and not is_tier else None,
            )
            self._subs[node_id] = (ident, sub)
            sub.start()
        attached: dict[tuple[str, int], dict[str, str]] = {}
        for info in infos:
            tier = tier_id(info)
            if tier is not None:
                attached.setdefault((info.model, info.block_size), {})[info.node_id] = tier
        self.index.set_tiers(attached)

    def _curve(self) -> CurveClient | None:
        if self._curve_keys is None and self._curve_client is not None:
            self._curve_keys = self._curve_client()  # once, and only when some node relays with CURVE
        if self._curve_keys is None:
            log.warning("a node relays its KV events with CURVE, but this router has no keys for it")
        return self._curve_keys

    def subscriber(self, node_id: str) -> KVEventSubscriber | None:
        entry = self._subs.get(node_id)
        return entry[1] if entry is not None else None

    def stats(self) -> dict[str, SubscriberStats]:
        return {node_id: sub.stats for node_id, (_, sub) in self._subs.items()}

    async def close(self) -> None:
        await self.sync([])
        if self._own_ctx:
            self._ctx.term()
