"""Which block leaves the host tier when a new one needs its slot.

The stated policy (``RetentionLru``): least recently used first, in two classes. A block pinned by a
live retention (a session's context kept across a tool pause, until its TTL) is evicted only when no
unpinned block is left, and then the pin that expires soonest goes first. Lookups that hit refresh a
block's recency (a chain's head last, so a chain's tail leaves before its head: a chain is of use only
from its head). The server keeps who pinned what above it (``server.py``: one pinned set per owner, a
budget per tenant) and calls ``unpin`` and ``demote`` for a session's superseded blocks.

Spares. The tier keeps its copies of blocks an engine on the host still holds apart, as spares, so that
under pressure it holds what the engines do not (exclusive, as a victim cache) rather than duplicate
them: a finished request's blocks are stored as spares (``Reserve(cold=True)``; one already held
keeps its place), blocks an engine just loaded from the tier become spares (``Demote``), and a block an
engine evicts is stored, or taken back from the spares, at the hot end (``Reserve(cold=False)``), the
tier's copy being the host's only one then. Spares leave before any other unpinned block, the oldest
first: a fresh one is the likeliest to be wanted by another node soon (parallel sessions on one
repository), an old one the likeliest to come back hot when its engine evicts it. A chain becomes
spares tail first, so its tail leaves first. Without pressure nothing leaves, so the tier still holds
every engine's blocks for an engine restart or the other node.

Pinned spares. A pin guards a session's context across its pause, but while the engine still holds a
block the tier's pinned copy guards nothing: kept, half the tier's pins would hold duplicates and crowd
out the only copies of everything else. So the order is: unpinned spares, then pinned spares
(``pinned_spare``; the server keeps their pins by key and puts them back when the engine evicts the
block and it is stored again, hot), then unpinned only-copies (``lru``), then pinned only-copies
(``pinned_lru``, the soonest expiry first). A block of the request being stored is never its victim
(``keep``: a request's blocks are one chain, of use only from its head).

``demote`` (a session's superseded blocks, ``server.py``) puts a block first in line to leave.

One policy per file behind ``EvictionPolicy`` (the server calls only these methods).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Set as AbstractSet
from typing import Protocol


class EvictionPolicy(Protocol):
    def add(self, slot: int) -> None: ...
    def touch(self, slot: int) -> None: ...
    def remove(self, slot: int) -> None: ...
    def pin(self, slot: int, until: float) -> None: ...
    def set_pin(self, slot: int, until: float) -> None: ...
    def unpin(self, slot: int) -> None: ...
    def demote(self, slot: int) -> None: ...
    def spare(self, slot: int) -> None: ...
    def victim(self, now: float, keep: AbstractSet[int] = frozenset()) -> tuple[int, str] | None:
        """The slot to evict and why (``lru``, ``pinned_spare`` or ``pinned_lru``), never one of ``keep``
        (the blocks of the request being stored); None if nothing else is held."""
        ...


class RetentionLru:
    def __init__(self) -> None:
        self._lru: OrderedDict[int, None] = OrderedDict()
        """Unpinned order of the tier's own copies, least recently used first."""
        self._spare: OrderedDict[int, None] = OrderedDict()
        """Copies an engine still holds, oldest first: they leave before anything in ``_lru``."""
        self._pinned: dict[int, float] = {}
        self._expiry: list[tuple[float, int]] = []  # heap; entries may be stale (checked against _pinned)

    def _held(self, slot: int) -> bool:
        return slot in self._lru or slot in self._spare

    def add(self, slot: int) -> None:
        self._spare.pop(slot, None)
        self._lru[slot] = None
        self._lru.move_to_end(slot)

    def touch(self, slot: int) -> None:
        if slot in self._spare:  # used again: the tier's copy is wanted, no longer a spare
            self.add(slot)
        elif slot in self._lru:
            self._lru.move_to_end(slot)

    def spare(self, slot: int) -> None:
        """An engine holds this block too: the newest spare."""
        if self._held(slot):
            self._lru.pop(slot, None)
            self._spare[slot] = None
            self._spare.move_to_end(slot)

    def remove(self, slot: int) -> None:
        self._lru.pop(slot, None)
        self._spare.pop(slot, None)
        self._pinned.pop(slot, None)

    def pin(self, slot: int, until: float) -> None:
        if not self._held(slot):
            return
        if until > self._pinned.get(slot, 0.0):
            self._pinned[slot] = until
            heapq.heappush(self._expiry, (until, slot))

    def set_pin(self, slot: int, until: float) -> None:
        """Pinned until exactly ``until`` (earlier or later than before: the server computes it over the
        slot's owners)."""
        if not self._held(slot):
            return
        self._pinned[slot] = until
        heapq.heappush(self._expiry, (until, slot))  # an older entry goes stale and is skipped

    def unpin(self, slot: int) -> None:
        self._pinned.pop(slot, None)  # its heap entry goes stale and is skipped

    def demote(self, slot: int) -> None:
        """Next to be evicted (unless pinned)."""
        if self._held(slot):
            self._lru.pop(slot, None)
            self._spare[slot] = None
            self._spare.move_to_end(slot, last=False)

    def is_pinned(self, slot: int, now: float) -> bool:
        until = self._pinned.get(slot)
        return until is not None and until > now

    def pinned(self, now: float) -> int:
        self._expire(now)
        return len(self._pinned)

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            until, slot = heapq.heappop(self._expiry)
            if self._pinned.get(slot) == until:
                del self._pinned[slot]

    def victim(self, now: float, keep: AbstractSet[int] = frozenset()) -> tuple[int, str] | None:
        self._expire(now)
        for slot in self._spare:  # oldest first; pinned and kept ones are skipped (few)
            if slot not in self._pinned and slot not in keep:
                return slot, "lru"
        for slot in self._spare:  # a pin guards a session's context, and its engine holds this copy
            if slot not in keep:
                return slot, "pinned_spare"
        for slot in self._lru:
            if slot not in self._pinned and slot not in keep:
                return slot, "lru"
        # pinned only-copies, the soonest expiry first
        while self._expiry and self._pinned.get(self._expiry[0][1]) != self._expiry[0][0]:
            heapq.heappop(self._expiry)  # stale
        if self._expiry and self._expiry[0][1] not in keep:
            return self._expiry[0][1], "pinned_lru"
        # the soonest is the storing request's own: the next live one in order (rare, so a sort is fine)
        live = (e for e in sorted(self._expiry) if self._pinned.get(e[1]) == e[0] and e[1] not in keep)
        first = next(live, None)
        return None if first is None else (first[1], "pinned_lru")
