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
from pathlib import Path

import msgspec
import zmq

from host_tier import messages as m
from host_tier.arena import Arena
from host_tier.events import EventPublisher
from host_tier.eviction import RetentionLru

log = logging.getLogger(__name__)


class TierCore:
    """The state machine above, with no sockets (the server loop feeds it decoded requests)."""

    def __init__(
        self,
        arena: Arena,
        events: EventPublisher | None = None,
        write_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.arena = arena
        self.events = events
        self.write_timeout_s = write_timeout_s
        self.clock = clock
        self.policy = RetentionLru()
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.writing: dict[int, tuple[bytes, float]] = {}
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
            return m.Welcome(str(a.path), a.slot_bytes, a.n_slots, a.fingerprint)
        if isinstance(req, m.Reserve):
            return m.Reserved([self._reserve(k) for k in req.keys])
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
            until = self.clock() + req.ttl_s
            n = 0
            for k in req.keys:
                pin_slot = self.by_key.get(k)
                if pin_slot is not None:
                    self.policy.pin(pin_slot, until)
                    n += 1
            return m.Pinned(n)
        if isinstance(req, m.Forget):
            for k in req.keys:
                gone = self.by_key.get(k)
                if gone is not None:
                    self._drop(gone)
                    self.forgotten[req.reason] += 1
            return m.Done()
        return self.stats()

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
        )

    def _reserve(self, key: bytes) -> int:
        slot = self.by_key.get(key)
        if slot is not None:
            self.policy.touch(slot)  # a store of what is held: refresh it, nothing to write
            return -1
        if not self.free:
            self.reclaim()
        if not self.free:
            victim = self.policy.victim(self.clock())
            if victim is None:
                return -1  # every slot is being written
            self._drop(victim[0])
            self.evictions[victim[1]] += 1
        slot = self.free.pop()
        self.writing[slot] = (key, self.clock())
        return slot

    def _commit(self, slots: list[int], keys: list[bytes]) -> None:
        stored = []
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
            stored.append(key)
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
            self.policy.touch(slot)
            out.append(slot)
        return out

    def _drop(self, slot: int) -> None:
        key = self.key_of.pop(slot)
        del self.by_key[key]
        self.policy.remove(slot)
        self.arena.invalidate(slot)
        self.free.append(slot)
        if self.events is not None:
            self.events.removed([key])

    def reclaim(self) -> None:
        """Take back reservations whose writer has not committed within ``write_timeout_s``."""
        cutoff = self.clock() - self.write_timeout_s
        for slot, (_, since) in list(self.writing.items()):
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
) -> None:
    """Run the tier until interrupted (KeyboardInterrupt / SIGTERM through ``contracts.cli.interrupt``)."""
    arena = Arena.create(path, slot_bytes, n_slots, fingerprint)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    events = EventPublisher(ctx, events_endpoint, block_size)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    core = TierCore(arena, events, write_timeout_s)
    log.info("host tier: %d slots of %d bytes at %s, control %s", n_slots, slot_bytes, path, endpoint)
    if ready is not None:
        ready()
    last_sweep = time.monotonic()
    try:
        while True:
            if sock.poll(1000):
                ident, empty, payload = sock.recv_multipart()
                try:
                    reply: m.Reply = core.handle(m.request_decoder.decode(payload))
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError, IndexError) as exc:
                    reply = m.Failed(f"bad request: {exc}")
                sock.send_multipart([ident, empty, m.encoder.encode(reply)])
            events.flush()
            if time.monotonic() - last_sweep > 1.0:
                core.reclaim()
                last_sweep = time.monotonic()
    finally:
        sock.close()
        events.close()
        ctx.term()
