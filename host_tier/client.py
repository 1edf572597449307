"""A process's handle on the host tier: control over one REQ socket, bytes through the shared file.

``put`` offloads blocks (Reserve -> copy into the mapping -> Commit); ``get`` loads the longest held
prefix of a chain of blocks, each verified by the seqlock and checksum (``arena.py``). A block that
fails verification is reported (``Forget``) and the chain stops there: the caller recomputes from
that block on. The client refuses a tier made for another layout (``layout.py``).

Not thread-safe (one REQ socket): give each thread its own client.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zmq

from contracts.errors import ConfigError
from host_tier import messages as m
from host_tier.arena import Arena


class TierUnavailable(ConfigError):
    """The tier did not answer: the caller carries on without it (compute, do not offload)."""


def ask(endpoint: str, req: m.Request, timeout_s: float = 2.0) -> m.Reply:
    """One request to the tier at ``endpoint`` on a socket of its own (for tools and agents that hold no
    ``TierClient``); raises ``TierUnavailable`` when it does not answer, ``ConfigError`` on ``Failed``."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(endpoint)
        sock.send(m.encoder.encode(req))
        reply = m.reply_decoder.decode(sock.recv())
    except zmq.Again as exc:
        raise TierUnavailable(f"host tier at {endpoint} did not answer in {timeout_s} s") from exc
    finally:
        sock.close()
    if isinstance(reply, m.Failed):
        raise ConfigError(f"host tier at {endpoint}: {reply.message}")
    return reply


def tier_endpoints(endpoint: str, timeout_s: float = 2.0) -> tuple[str | None, str | None]:
    """The (events, replay) endpoints the tier at ``endpoint`` publishes on, from one ``Hello``."""
    reply = ask(endpoint, m.Hello(), timeout_s)
    assert isinstance(reply, m.Welcome)
    return reply.events_endpoint, reply.replay_endpoint


class TierClient:
    def __init__(self, endpoint: str, fingerprint: bytes, timeout_s: float = 2.0) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._endpoint = endpoint
        self._timeout_ms = int(timeout_s * 1000)
        self._sock = self._connect()
        self._notices: zmq.Socket[bytes] | None = None
        """A DEALER for the notices nothing answers (``demote``), made at the first one."""
        self.notices_dropped = 0
        welcome = self._call(m.Hello())
        assert isinstance(welcome, m.Welcome)
        if welcome.fingerprint != fingerprint:
            raise ConfigError(
                f"the host tier at {endpoint} holds blocks of another layout (model, dtype, block size, "
                "layers or hash seed differ): start one tier per layout"
            )
        self.arena = Arena.open(Path(welcome.path))
        self.block_bytes = welcome.slot_bytes

    def set_timeout(self, timeout_s: float) -> None:
        """Change the reply timeout (e.g. generous to connect, short on a serving path)."""
        self._timeout_ms = int(timeout_s * 1000)
        self._sock.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
        self._sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)

    def _connect(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        sock.connect(self._endpoint)
        return sock

    def _call(self, req: m.Request) -> m.Reply:
        try:
            self._sock.send(m.encoder.encode(req))
            reply = m.reply_decoder.decode(self._sock.recv())
        except zmq.Again as exc:
            # A REQ socket that missed its reply is stuck mid-exchange: replace it for the next call.
            self._sock.close()
            self._sock = self._connect()
            raise TierUnavailable(f"host tier at {self._endpoint} did not answer in {self._timeout_ms} ms") from exc
        if isinstance(reply, m.Failed):
            raise ConfigError(f"host tier: {reply.message}")
        return reply

    # -- blocks ------------------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], blocks: Sequence[np.ndarray | bytes | memoryview]) -> int:
        """Offload blocks the tier does not hold yet. Returns how many were stored."""
        return self.put_parts(keys, [[np.frombuffer(b, dtype=np.uint8)] for b in blocks])

    def put_parts(self, keys: Sequence[bytes], blocks: Sequence[list[np.ndarray]], *, cold: bool = False) -> int:
        """``put`` for blocks held in pieces (an engine's cache: one piece per layer), gathered straight
        into their slots. ``cold``: the caller keeps its own copy (see ``eviction.py``)."""
        reserved = self._call(m.Reserve(list(keys), cold))
        assert isinstance(reserved, m.Reserved)
        mine = [(slot, key, parts) for slot, key, parts in zip(reserved.slots, keys, blocks, strict=True) if slot >= 0]
        sealed: list[tuple[int, bytes]] = []
        try:
            for slot, key, parts in mine:
                if self.arena.write_gather(slot, key, parts):
                    sealed.append((slot, key))
        except BaseException:
            # Give every reservation back at once rather than leave them to the reclaim timeout.
            self._call(m.Abort([s for s, _, _ in mine], [k for _, k, _ in mine]))
            raise
        if sealed:
            self._call(m.Commit([s for s, _ in sealed], [k for _, k in sealed]))
        return len(sealed)

    def slots(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of the longest held prefix of ``keys`` (read them with ``arena.read_scatter``, which
        checks each still holds its key: a slot reused since fails the read, never serves other bytes)."""
        found = self._call(m.Lookup(list(keys)))
        assert isinstance(found, m.Found)
        return found.slots

    def demote(self, keys: Sequence[bytes]) -> None:
        """The caller now holds its own copies of these blocks: the tier's become spares (``eviction.py``).

        A notice, sent without waiting: an engine that just loaded blocks does not wait on the tier's
        process, which on a host whose cores the engines keep busy answers in milliseconds, not
        microseconds. A notice the socket cannot queue is dropped and counted: the tier then keeps those
        copies where they were in line, which costs room, not correctness."""
        if self._notices is None:
            self._notices = self._ctx.socket(zmq.DEALER)
            self._notices.setsockopt(zmq.LINGER, 0)
            self._notices.setsockopt(zmq.SNDHWM, 1024)
            self._notices.connect(self._endpoint)
        try:
            # The empty frame a REQ socket puts first: the server's ROUTER reads both kinds alike.
            self._notices.send_multipart([b"", m.encoder.encode(m.Demote(list(keys)))], zmq.NOBLOCK)
        except zmq.Again:
            self.notices_dropped += 1

    def forget(self, keys: Sequence[bytes], reason: str = "corrupt") -> None:
        self._call(m.Forget(list(keys), reason))

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of the chain the tier holds (no copy)."""
        found = self._call(m.Lookup(list(keys)))
        assert isinstance(found, m.Found)
        return len(found.slots)

    def get(self, keys: Sequence[bytes], out: Sequence[np.ndarray] | None = None) -> list[bytes] | int:
        """Load the longest held, verified prefix of ``keys``. With ``out`` (one uint8 array per key),
        copy into those and return how many were filled; without, return the blocks' bytes."""
        found = self._call(m.Lookup(list(keys)))
        assert isinstance(found, m.Found)
        blocks: list[bytes] = []
        n = 0
        for i, slot in enumerate(found.slots):
            key = keys[i]
            if out is not None:
                ok = self.arena.read_into(slot, key, out[i].reshape(-1).view(np.uint8))
            else:
                data = self.arena.read(slot, key)
                ok = data is not None
                if data is not None:
                    blocks.append(data)
            if not ok:
                self._call(m.Forget([key], "corrupt"))
                break
            n += 1
        return n if out is not None else blocks

    def pin(self, keys: Sequence[bytes], ttl_s: float, owner: str = "", tenant: str = "") -> m.Pinned:
        """Keep the held blocks of ``keys`` for ``ttl_s`` as ``owner``'s (replacing its previous pins),
        within ``tenant``'s budget."""
        pinned = self._call(m.Pin(list(keys), ttl_s, owner, tenant))
        assert isinstance(pinned, m.Pinned)
        return pinned

    def stats(self) -> m.TierStats:
        stats = self._call(m.Stats())
        assert isinstance(stats, m.TierStats)
        return stats

    def close(self) -> None:
        self._sock.close()
        if self._notices is not None:
            self._notices.close()
        self.arena.close()
