"""The tier's store/remove events, in vLLM's KV-event wire format, so the router's fleet index reads
them with the subscriber it already runs for engines (``router/kv_index/events.py`` documents the
format: ``[topic, seq (8 bytes, big-endian), msgpack([ts, [event...], None])]`` on a PUB socket).

``medium`` says which tier holds the block (``MEDIUM``), so the index can tell an engine's own cache
from the host's. Keys are published as vLLM publishes them by default: the low 64 bits of the block
hash, as an int. Events are batched per server loop turn and sent without waiting (PUB drops for a
slow subscriber; a subscriber that sees a gap in ``seq`` resyncs from ``Lookup``).
"""

from __future__ import annotations

import time

import msgspec
import zmq

MEDIUM = "CPU_SHM"
TOPIC = b"kv@host_tier"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay's end marker, as vLLM's publisher sends it."""
_MASK64 = (1 << 64) - 1


class BlockStored(msgspec.Struct, tag=True, kw_only=True):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str = MEDIUM


class BlockRemoved(msgspec.Struct, tag=True, kw_only=True):
    block_hashes: list[int]
    medium: str = MEDIUM


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def event_key(key: bytes) -> int:
    return int.from_bytes(key, "big") & _MASK64


class EventPublisher:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str | None, block_size: int) -> None:
        self._sock = ctx.socket(zmq.PUB) if endpoint else None
        if self._sock is not None and endpoint:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.bind(endpoint)
        self._block_size = block_size
        self._events: list[Event] = []
        self._seq = 0
        self._last = 0.0
        self._enc = msgspec.msgpack.Encoder()

    def stored(self, keys: list[bytes]) -> None:
        if self._sock is not None and keys:
            self._events.append(BlockStored(block_hashes=[event_key(k) for k in keys], block_size=self._block_size))

    def removed(self, keys: list[bytes]) -> None:
        if self._sock is not None and keys:
            self._events.append(BlockRemoved(block_hashes=[event_key(k) for k in keys]))

    def _snapshot(self, keys: list[bytes]) -> list[Event]:
        stored = BlockStored(block_hashes=[event_key(k) for k in keys], block_size=self._block_size)
        return [AllBlocksCleared(), *([stored] if keys else [])]

    def start(self, keys: list[bytes]) -> None:
        """Publish seq 0: the blocks held at start (recovered from the file), as a snapshot."""
        if self._sock is not None:
            self._events = self._snapshot(keys)
            self.flush()

    def flush(self, *, heartbeat_s: float | None = None) -> None:
        """Publish what was batched; with nothing batched, an empty batch if ``heartbeat_s`` passed since
        the last one. Why the heartbeat: PUB drops what it sends before a subscriber has (re)connected,
        so a restarted tier's seq 0 is often heard by no one; the next batch's seq, lower than the one a
        subscriber expects, is how it learns of the restart (and resyncs from a snapshot) within
        ``heartbeat_s`` even when no block is stored."""
        if self._sock is None:
            return
        now = time.monotonic()
        if not self._events and (heartbeat_s is None or now - self._last < heartbeat_s):
            return
        payload = self._enc.encode(_Batch(ts=time.time(), events=self._events))
        self._events = []
        self._sock.send_multipart([TOPIC, self._seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        self._seq += 1
        self._last = now

    def replay(self, start: int, keys: list[bytes]) -> list[tuple[int, bytes]]:
        """The answer to a replay from ``start``: nothing when no batch that late was published, else the
        snapshot of ``keys`` (every block held now) as the latest published batch. Call after
        ``flush``, so the snapshot includes every event published."""
        last = self._seq - 1
        if start > last:
            return []
        return [(last, self._enc.encode(_Batch(ts=time.time(), events=self._snapshot(keys))))]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
