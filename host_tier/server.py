"""The host tier's one owner: the process that hands out slots, keeps the index and publishes events.

One per host and layout (``tandem tier serve``). Engines come and go; the tier and its blocks stay, so
an engine restarted after a crash finds its prompts' blocks here instead of recomputing them, and the
server itself rebuilds its index from the file (``Arena.scan``) when it restarts.

A slot's states and who moves it:

    free --Reserve--> writing --Commit--> held --evict / Forget--> free
                         |                  ^ |
                         +--Abort / writer  | +--Lookup hit, Pin (recency, retention)
                            gone after      |
                            write_timeout_s +-- a Reserve of a key already held answers -1
                            --> free

Only ``free`` slots are handed out, and a slot leaves ``held`` only here, invalidated in the file
first (``Arena.invalidate``), so a reader racing an eviction fails its seqlock test rather than read a
half-overwritten block. A ``writing`` slot is not in the index and not evictable; its writer gets
``write_timeout_s`` to commit, so a client killed mid-copy leaves no space behind.

The bound: ``n_slots`` fixed at creation from the configured size. When every slot is held, a Reserve
evicts by the policy (``eviction.py``); when every slot is being written, it answers -1 (the caller
simply does not offload that block).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq

from host_tier import messages as m
from host_tier.arena import Arena
from host_tier.events import END_SEQ, TOPIC, EventPublisher
from host_tier.eviction import RetentionLru
from host_tier.metrics import serve_metrics

if TYPE_CHECKING:  # the lake's rows load the telemetry package (Arrow, Redis): only a tier that emits them
    from host_tier.lake import TierLake

log = logging.getLogger(__name__)


class TierCore:
    """The state machine above, with no sockets (the server loop feeds it decoded requests)."""

    def __init__(
        self,
        arena: Arena,
        events: EventPublisher | None = None,
        write_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        endpoints: tuple[str | None, str | None] = (None, None),
        tenant_pin_share: float = 0.5,
    ) -> None:
        """``endpoints``: (events, replay), told to clients in ``Welcome``; ``tenant_pin_share``: the share
        of the slots one tenant's pins may hold."""
        self.arena = arena
        self.endpoints = endpoints
        self.pin_budget = max(int(arena.n_slots * tenant_pin_share), 1)
        self.owner_pins: dict[str, tuple[str, float, set[bytes]]] = {}
        """owner -> (tenant, until, the keys its last Pin pinned); dropped when it expires (``reclaim``)."""
        self.tenant_pins: Counter[str] = Counter()
        self.key_owners: dict[bytes, dict[str, float]] = {}
        """key -> {owner: until}: who pins it, each until when (several sessions may share a prefix). By
        key, not slot: a pinned spare may leave while its engine holds the block, and its pin waits here
        for the block to come back (``_commit``)."""
        self.pinned_hits = self.pins_refused = self.demoted = 0
        self.events = events
        self.write_timeout_s = write_timeout_s
        self.clock = clock
        self.policy = RetentionLru()
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.writing: dict[int, tuple[bytes, float, bool]] = {}
        """slot -> (key, reserved at, cold) of a reservation not committed yet."""
        self.free: list[int] = []
        self.stored = self.hits = self.misses = self.reclaimed = 0
        self.evictions: Counter[str] = Counter()
        self.forgotten: Counter[str] = Counter()
        held = set()
        for rec in arena.scan():
            if rec.key in self.by_key:  # two copies of one block (a crash between writes): keep one
                arena.invalidate(rec.slot)
                continue
            self.by_key[rec.key] = rec.slot
            self.key_of[rec.slot] = rec.key
            self.policy.add(rec.slot)
            held.add(rec.slot)
        for slot in range(arena.n_slots - 1, -1, -1):
            if slot not in held:
                if arena.gen(slot) % 2:  # a write that never finished before the restart
                    arena.invalidate(slot)
                self.free.append(slot)
        if held:
            log.info("host tier: %d blocks recovered from %s", len(held), arena.path)

    # -- requests ----------------------------------------------------------------------------------------
    def handle(self, req: m.Request) -> m.Reply:
        if isinstance(req, m.Hello):
            if req.protocol != m.PROTOCOL:
                return m.Failed(f"host tier speaks protocol {m.PROTOCOL}, client {req.protocol}")
            a = self.arena
            return m.Welcome(str(a.path), a.slot_bytes, a.n_slots, a.fingerprint, m.PROTOCOL, *self.endpoints)
        if isinstance(req, m.Reserve):
            # A store never evicts a block of its own request: a request's keys are one chain, useful
            # only from its head, so dropping its held head to store its tail loses both (a finished
            # request's cold copy of a shared prefix plus its own task blocks, under pressure, would
            # otherwise evict the prefix's last block: the oldest spare left).
            keep = frozenset(s for k in req.keys if (s := self.by_key.get(k)) is not None)
            return m.Reserved([self._reserve(k, req.cold, keep) for k in req.keys])
        if isinstance(req, m.Commit):
            self._commit(req.slots, req.keys)
            return m.Done()
        if isinstance(req, m.Abort):
            for slot, key in zip(req.slots, req.keys, strict=True):
                w = self.writing.get(slot)
                if w is not None and w[0] == key:  # a stale Abort never frees another writer's slot
                    del self.writing[slot]
                    self.arena.invalidate(slot)
                    self.free.append(slot)
            return m.Done()
        if isinstance(req, m.Lookup):
            return m.Found(self._lookup(req.keys, req.prefix))
        if isinstance(req, m.Pin):
            return self._pin(req)
        if isinstance(req, m.Demote):
            for k in reversed(req.keys):  # a chain's tail the oldest spare: it leaves first
                if (held := self.by_key.get(k)) is not None:
                    self.policy.spare(held)
            return m.Done()
        if isinstance(req, m.Forget):
            for k in req.keys:
                gone = self.by_key.get(k)
                if gone is not None:
                    self._drop(gone)
                    self.forgotten[req.reason] += 1
            return m.Done()
        return self.stats()

    def _pin(self, req: m.Pin) -> m.Pinned:
        """Pin the held blocks of ``req.keys`` until the TTL, in order (a prompt's leading blocks, its
        shared context, first) while the tenant's budget lasts. The owner's previous set is replaced:
        blocks it no longer names lose its pin, and those no other owner pins are demoted. A slot stays
        pinned until the latest expiry among its live owners (so a shorter re-pin shortens it, and the
        budget it frees is real). A Pin with no owner (an operator's) is neither budgeted nor replaced."""
        until = self.clock() + req.ttl_s
        if not req.owner:
            held = [slot for k in req.keys if (slot := self.by_key.get(k)) is not None]
            for slot in held:
                self.policy.pin(slot, until)
            return m.Pinned(len(held))
        tenant, _, before = self.owner_pins.pop(req.owner, (req.tenant, 0.0, set()))
        self.tenant_pins[tenant] -= len(before)
        for k in before:
            self.key_owners.get(k, {}).pop(req.owner, None)
        pinned: set[bytes] = set()
        refused = 0
        for k in req.keys:
            if k not in self.by_key or k in pinned:
                continue
            if self.tenant_pins[req.tenant] + len(pinned) >= self.pin_budget:
                refused += 1
                continue
            pinned.add(k)
            self.key_owners.setdefault(k, {})[req.owner] = until
            self._set_pin(k)
        for k in before - pinned:
            shared = bool(self.key_owners.get(k))  # another session sharing the prefix still keeps it
            self._set_pin(k)
            if not shared and (slot := self.by_key.get(k)) is not None:
                self.policy.demote(slot)
                self.demoted += 1
        if pinned:
            self.owner_pins[req.owner] = (req.tenant, until, pinned)
            self.tenant_pins[req.tenant] += len(pinned)
        self.pins_refused += refused
        return m.Pinned(len(pinned), refused)

    def _set_pin(self, key: bytes) -> None:
        """The key's pin: the latest expiry among its owners, or none when it has none left (a key not
        held keeps its owners, waiting for the block to be stored again)."""
        owners = self.key_owners.get(key)
        if not owners:
            self.key_owners.pop(key, None)
        slot = self.by_key.get(key)
        if slot is None:
            return
        if owners:
            self.policy.set_pin(slot, max(owners.values()))
        else:
            self.policy.unpin(slot)

    def _unpin_key(self, key: bytes) -> None:
        """A pinned block leaves the tier for good: it no longer counts against its owners' tenants."""
        for owner in self.key_owners.pop(key, {}):
            entry = self.owner_pins.get(owner)
            if entry is None:
                continue
            tenant, _, keys = entry
            keys.discard(key)
            self.tenant_pins[tenant] -= 1
            if not keys:
                del self.owner_pins[owner]

    def stats(self) -> m.TierStats:
        return m.TierStats(
            n_slots=self.arena.n_slots,
            slot_bytes=self.arena.slot_bytes,
            held=len(self.by_key),
            writing=len(self.writing),
            pinned=self.policy.pinned(self.clock()),
            stored=self.stored,
            hits=self.hits,
            misses=self.misses,
            evictions=dict(self.evictions),
            forgotten=dict(self.forgotten),
            reclaimed=self.reclaimed,
            pinned_hits=self.pinned_hits,
            pins_refused=self.pins_refused,
            demoted=self.demoted,
        )

    def _reserve(self, key: bytes, cold: bool = False, keep: AbstractSet[int] = frozenset()) -> int:
        slot = self.by_key.get(key)
        if slot is not None:
            if not cold:
                self.policy.touch(slot)  # an engine's only copy of what is held: refresh it, nothing to write
            return -1
        if not self.free:
            self.reclaim()
        if not self.free:
            victim = self.policy.victim(self.clock(), keep)
            if victim is None:
                return -1  # every slot is being written, or held by this same request
            # a pinned spare's engine still holds the block: its pin waits for the block to come back
            self._drop(victim[0], keep_pin=victim[1] == "pinned_spare")
            self.evictions[victim[1]] += 1
        slot = self.free.pop()
        self.writing[slot] = (key, self.clock(), cold)
        return slot

    def _commit(self, slots: list[int], keys: list[bytes]) -> None:
        stored, spares = [], []
        for slot, key in zip(slots, keys, strict=True):
            w = self.writing.get(slot)
            if w is None or w[0] != key:
                # Reclaimed meanwhile (a writer slower than write_timeout_s), maybe handed to another
                # writer since: this copy is void, and the slot's new reservation is left alone.
                continue
            del self.writing[slot]
            if self.arena.gen(slot) % 2 or key in self.by_key:
                self.arena.invalidate(slot)  # never sealed, or a duplicate committed by another writer
                self.free.append(slot)
                continue
            self.by_key[key] = slot
            self.key_of[slot] = key
            self.policy.add(slot)
            if w[2]:
                spares.append(slot)
            if key in self.key_owners:  # a pinned spare that left while its engine held it, back
                self._set_pin(key)
            stored.append(key)
        for slot in reversed(spares):  # a chain's tail the oldest spare: it leaves first
            self.policy.spare(slot)
        self.stored += len(stored)
        if self.events is not None:
            self.events.stored(stored)

    def _lookup(self, keys: list[bytes], prefix: bool) -> list[int]:
        out = []
        for k in keys:
            slot = self.by_key.get(k)
            if slot is None:
                self.misses += 1
                if prefix:
                    break
                out.append(-1)
                continue
            self.hits += 1
            if self.policy.is_pinned(slot, self.clock()):
                self.pinned_hits += 1
            out.append(slot)
        # A chain is only of use from its head: refreshed last, the head is the last of it to leave.
        for slot in reversed(out):
            if slot >= 0:
                self.policy.touch(slot)
        return out

    def _drop(self, slot: int, *, keep_pin: bool = False) -> None:
        key = self.key_of.pop(slot)
        if key in self.key_owners and not keep_pin:
            self._unpin_key(key)
        del self.by_key[key]
        self.policy.remove(slot)
        self.arena.invalidate(slot)
        self.free.append(slot)
        if self.events is not None:
            self.events.removed([key])

    def reclaim(self) -> None:
        """Take back reservations whose writer has not committed within ``write_timeout_s``, and forget
        the owners whose pins expired (their blocks stay, as plain LRU ones; the budget is free again)."""
        now = self.clock()
        for owner, (tenant, until, keys) in list(self.owner_pins.items()):
            if until <= now:
                del self.owner_pins[owner]
                self.tenant_pins[tenant] -= len(keys)
                for k in keys:
                    self.key_owners.get(k, {}).pop(owner, None)
                    self._set_pin(k)
        cutoff = now - self.write_timeout_s
        for slot, (_, since, _) in list(self.writing.items()):
            if since < cutoff:
                del self.writing[slot]
                self.arena.invalidate(slot)
                self.free.append(slot)
                self.reclaimed += 1


def serve(
    path: Path,
    slot_bytes: int,
    n_slots: int,
    fingerprint: bytes,
    endpoint: str,
    events_endpoint: str | None,
    block_size: int,
    write_timeout_s: float = 30.0,
    ready: Callable[[], None] | None = None,
    replay_endpoint: str | None = None,
    tenant_pin_share: float = 0.5,
    metrics_port: int | None = None,
    lake: TierLake | None = None,
) -> None:
    """Run the tier until interrupted (KeyboardInterrupt / SIGTERM through ``contracts.cli.interrupt``).
    ``lake``: where the loop hands its ``host_tier`` rows (``host_tier.lake``; it only appends to the
    emitter's buffer, never waits on Redis); its last row is emitted at the end."""
    arena = Arena.create(path, slot_bytes, n_slots, fingerprint)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    events = EventPublisher(ctx, events_endpoint, block_size)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    replay = ctx.socket(zmq.ROUTER) if replay_endpoint else None
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if replay is not None and replay_endpoint:
        replay.setsockopt(zmq.LINGER, 0)
        replay.bind(replay_endpoint)
        poller.register(replay, zmq.POLLIN)
    core = TierCore(
        arena, events, write_timeout_s, endpoints=(events_endpoint, replay_endpoint), tenant_pin_share=tenant_pin_share
    )
    events.start(list(core.by_key))
    collector = serve_metrics(metrics_port) if metrics_port else None
    if collector is not None:
        collector.snapshot = core.stats()
    log.info("host tier: %d slots of %d bytes at %s, control %s", n_slots, slot_bytes, path, endpoint)
    if ready is not None:
        ready()
    last_sweep = time.monotonic()
    try:
        while True:
            ready_socks = dict(poller.poll(500))
            if sock in ready_socks:
                ident, empty, payload = sock.recv_multipart()
                notice = False
                try:
                    req = m.request_decoder.decode(payload)
                    notice = isinstance(req, m.Demote)  # nothing comes back: bookkeeping a load never waits for
                    reply: m.Reply = core.handle(req)
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError, IndexError) as exc:
                    reply = m.Failed(f"bad request: {exc}")
                    if notice:
                        log.warning("host tier: a notice refused: %s", reply.message)
                if not notice:
                    sock.send_multipart([ident, empty, m.encoder.encode(reply)])
            events.flush(heartbeat_s=1.0)
            if replay is not None and replay in ready_socks:
                _answer_replay(replay, events, core)
            if time.monotonic() - last_sweep > 1.0:
                core.reclaim()
                if collector is not None:
                    collector.snapshot = core.stats()
                if lake is not None:
                    lake.tick(core.stats)
                last_sweep = time.monotonic()
    finally:
        if lake is not None:
            lake.close(core.stats())
        sock.close()
        if replay is not None:
            replay.close()
        events.close()
        ctx.term()


def _answer_replay(replay: zmq.Socket[bytes], events: EventPublisher, core: TierCore) -> None:
    """A subscriber's ``[b"", start_seq]`` (vLLM's replay request), answered as vLLM's publisher answers:
    ``[b"", topic, seq, batch]`` frames, then the end marker."""
    frames = replay.recv_multipart()
    if len(frames) != 3 or len(frames[2]) != 8:
        return
    ident, start = frames[0], int.from_bytes(frames[2], "big")
    for seq, payload in events.replay(start, list(core.by_key)):
        replay.send_multipart([ident, b"", TOPIC, seq.to_bytes(8, "big"), payload])
    replay.send_multipart([ident, b"", b"", END_SEQ, b""])
