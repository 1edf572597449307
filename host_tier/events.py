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


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved]
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
        self._events: list[BlockStored | BlockRemoved] = []
        self._seq = 0
        self._enc = msgspec.msgpack.Encoder()

    def stored(self, keys: list[bytes]) -> None:
        if self._sock is not None and keys:
            self._events.append(BlockStored(block_hashes=[event_key(k) for k in keys], block_size=self._block_size))

    def removed(self, keys: list[bytes]) -> None:
        if self._sock is not None and keys:
            self._events.append(BlockRemoved(block_hashes=[event_key(k) for k in keys]))

    def flush(self) -> None:
        if self._sock is None or not self._events:
            return
        payload = self._enc.encode(_Batch(ts=time.time(), events=self._events))
        self._events = []
        self._sock.send_multipart([TOPIC, self._seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        self._seq += 1

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
