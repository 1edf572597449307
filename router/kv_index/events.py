"""vLLM's KV-event wire format, mirrored so the router decodes events without importing vLLM.

Source: vllm 0.32 ``vllm/distributed/kv_events.py``:
  * ``EventBatch`` is a msgspec Struct with ``array_like=True``: ``[ts, events, data_parallel_rank]``.
  * ``KVCacheEvent`` subclasses are tagged structs (``tag=True``): a msgpack map with
    ``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"`` and the fields below.
  * ``ZmqEventPublisher._publisher_thread`` sends ``[topic, seq.to_bytes(8, "big"), payload]`` on a
    PUB socket, ``payload = msgspec.msgpack.Encoder().encode(batch)``; ``seq`` counts from 0 per
    publisher (so per engine start) and each batch is kept in a replay buffer (``buffer_steps``).
  * ``ZmqEventPublisher._service_replay``: a ROUTER socket receives ``[client_id, b"", start_seq]``
    (8-byte big-endian), answers every buffered ``[client_id, b"", topic, seq, payload]`` with
    ``seq >= start_seq``, then ``[client_id, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]``.
Fields the router does not use are left out (msgspec ignores unknown map keys), and an event type we
do not know is skipped rather than failing its batch, so a newer vLLM does not break the router.
"""

from __future__ import annotations

import msgspec

REPLAY_END_SEQ = -1


class BlockStored(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[object] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class EventBatch(msgspec.Struct, frozen=True):
    ts: float
    events: list[KVEvent]
    skipped: int = 0
    """Events of a type this router does not know (ignored)."""


_batch_decoder = msgspec.msgpack.Decoder(_WireBatch)
_event_decoder = msgspec.msgpack.Decoder(KVEvent)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one published payload. Raises ``msgspec.DecodeError`` if the batch itself is malformed."""
    wire = _batch_decoder.decode(payload)
    events: list[KVEvent] = []
    skipped = 0
    for raw in wire.events:
        try:
            events.append(_event_decoder.decode(raw))
        except msgspec.ValidationError:
            skipped += 1
    return EventBatch(ts=wire.ts, events=events, skipped=skipped)
