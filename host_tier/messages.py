"""The host tier's control messages (client <-> server), msgpack over one ZeroMQ REQ/ROUTER pair.

Versioned: ``Hello`` carries ``PROTOCOL`` and a server answers another version with ``Failed``. Only
slot numbers and keys cross this socket; block bytes never do (clients copy through the shared file).

    Hello                          -> Welcome(path, geometry, fingerprint, event endpoints)
    Reserve(keys, cold)            -> Reserved(slots)       one per key, -1 = already held or no room;
                                                            cold: an engine still holds these blocks
                                                            (stored as spares, ``eviction.py``)
    Commit(slots, keys)            -> Done                  written and sealed: now readable, evictable
    Abort(slots, keys)             -> Done                  a reservation given back unwritten
    Lookup(keys, prefix)           -> Found(slots)          -1 = not held; prefix: stop at the first miss
    Pin(keys, ttl_s, owner, tenant) -> Pinned(n, refused)  kept across a pause: the owner's pinned set
                                                            becomes ``keys`` (what it pinned before and
                                                            no longer names is unpinned and demoted);
                                                            past the tenant's budget, refused
    Forget(keys, reason)           -> Done                  a reader found a block corrupt or stale
    Demote(keys)                   -> (nothing: a notice)   an engine just loaded these: the tier's
                                                            copies are spares now (the engine sends it
                                                            and never waits on the tier)
    Stats                          -> TierStats

Versions: 1, the first; 2 adds ``Reserve.cold`` and ``Demote`` (a version-1 server could not decode
``Demote``, so the handshake refuses it); 3 makes ``Demote`` a notice (a version-2 server would
answer it, and the answers would pile up unread on the sender's socket).

A notice comes on a DEALER socket of its own (``TierClient.demote``), framed as a REQ socket frames a
request, so the server's one ROUTER socket takes both; the server sends nothing back to it.
"""

from __future__ import annotations

import msgspec

PROTOCOL = 3


class Hello(msgspec.Struct, tag=True):
    protocol: int = PROTOCOL


class Reserve(msgspec.Struct, tag=True):
    keys: list[bytes]
    cold: bool = False
    """Copies of blocks an engine still holds (offloaded when its request ended): stored as spares, which
    leave first, and a key already held keeps its place. Otherwise (an engine evicting its only copy)
    new blocks go to the hot end and a held one is refreshed."""


class Commit(msgspec.Struct, tag=True):
    slots: list[int]
    keys: list[bytes]


class Abort(msgspec.Struct, tag=True):
    slots: list[int]
    keys: list[bytes]


class Lookup(msgspec.Struct, tag=True):
    keys: list[bytes]
    prefix: bool = True


class Pin(msgspec.Struct, tag=True):
    keys: list[bytes]
    ttl_s: float
    owner: str = ""
    """Who holds the pins (a session): its next Pin replaces this one's set."""
    tenant: str = ""
    """Whose budget they count against."""


class Forget(msgspec.Struct, tag=True):
    keys: list[bytes]
    reason: str = "corrupt"


class Demote(msgspec.Struct, tag=True):
    keys: list[bytes]


class Stats(msgspec.Struct, tag=True):
    pass


Request = Hello | Reserve | Commit | Abort | Lookup | Pin | Forget | Demote | Stats


class Welcome(msgspec.Struct, tag=True):
    path: str
    slot_bytes: int
    n_slots: int
    fingerprint: bytes
    protocol: int = PROTOCOL
    events_endpoint: str | None = None
    """Where the tier publishes store/remove events (a node agent puts it in its registry entry)."""
    replay_endpoint: str | None = None


class Reserved(msgspec.Struct, tag=True):
    slots: list[int]


class Found(msgspec.Struct, tag=True):
    slots: list[int]


class Pinned(msgspec.Struct, tag=True):
    n: int
    refused: int = 0
    """Held blocks not pinned: the tenant's budget was spent."""


class Done(msgspec.Struct, tag=True):
    pass


class Failed(msgspec.Struct, tag=True):
    message: str


class TierStats(msgspec.Struct, tag=True):
    n_slots: int
    slot_bytes: int
    held: int
    writing: int
    pinned: int
    stored: int
    hits: int
    misses: int
    evictions: dict[str, int]
    forgotten: dict[str, int]
    reclaimed: int
    """Reservations whose writer vanished, taken back after ``write_timeout_s``."""
    pinned_hits: int = 0
    """Lookup hits on pinned blocks: context a retention kept through a pause (or through pressure)."""
    pins_refused: int = 0
    """Blocks a Pin asked for beyond its tenant's budget."""
    demoted: int = 0
    """Blocks a session's next Pin no longer named (a superseded turn's tail), first in line to leave."""


Reply = Welcome | Reserved | Found | Pinned | Done | Failed | TierStats

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()
