"""The block wire format and the control messages between a decode node (which pulls) and a prefill
node (which holds the blocks under a lease and serves them).

Every message is a msgspec struct, tagged and versioned (``kv.<name>.v1``), msgpack-encoded, sent as
the first ZeroMQ frame. Block data never goes through msgpack: a ``LayerHeader`` frame is followed by
one raw frame per segment (the bytes of ``count`` consecutive blocks of that layer, exactly as they lie
in the engine's paged KV cache), so both ends can send from and receive into the cache itself.

    decode (DEALER)                                prefill (ROUTER)
      Pull(transfer_id, segments, transport) ───▶  lease HELD → SENDING
                                             ◀───  LayerHeader(layer 0) + raw segment frames
                                             ◀───  ...one header per layer...
                                             ◀───  End            (zmq transports)
                                             ◀───  Grant(pid, addresses, checksums, pushing)   (shm: D
                                                   copies the layers P is not pushing; P writes those
                                                   straight into D's cache meanwhile)
                                             ◀───  Pushed(ok | reason)   (shm: P's share is in place)
                                             ◀───  UcxPosted(checksums)   (ucx: blocks went over UCX)
      Done(ok | reason)                      ───▶  lease released, blocks freed
      Release(reason)                        ───▶  lease released without a transfer (reject, abort)
    router (DEALER)
      Query(transfer_id)                     ───▶
                                             ◀───  LeaseReport(state, bytes, start, end)  (the lake's
                                                   transfer fields for streamed answers)
                                             ◀───  Reject(reason) instead of data: unknown/expired lease
"""

from __future__ import annotations

import msgspec

PROTOCOL = 1


class Segment(msgspec.Struct, array_like=True, frozen=True):
    """``count`` blocks starting at ``remote`` on the prefill node and at ``local`` on the decode node;
    consecutive on both sides, so one segment of one layer is one contiguous byte range on each."""

    remote: int
    local: int
    count: int


class UcxTarget(msgspec.Struct, array_like=True, frozen=True):
    """Where the blocks of a ``ucx`` pull go (see ucx.py)."""

    address: bytes
    """UCX worker address of the receiving decode thread (opaque; a few hundred bytes)."""
    tag: int
    """This pull's 32-bit tag on that worker; segment tags are ``tag << 32 | layer * len(segments) + i``."""
    block_nbytes: int
    """Bytes of one block of one layer in the decode cache; the prefill node refuses any other size."""


class CmaTarget(msgspec.Struct, array_like=True, frozen=True):
    """Where a decode node's cache lies, for a ``shm`` pull in which the prefill node copies part of
    the blocks itself (``push_layers``) with ``process_vm_writev``: two cores copy at once, one in
    each process, instead of one."""

    pid: int
    layer_addresses: list[int]
    """Address of block 0 of each layer in the decode process."""
    block_nbytes: int
    num_blocks: int
    push_layers: list[int]
    """Layers the prefill node is asked to write; the decode node reads every other layer itself."""


class Pull(msgspec.Struct, tag="kv.pull.v1", frozen=True):
    transfer_id: str
    segments: list[Segment]
    transport: str
    """``tcp`` / ``ipc`` (blocks come back as frames on this socket), ``shm`` (the prefill node
    answers with a Grant and the decode node copies the blocks straight out of its memory) or ``ucx``
    (the prefill node sends them over UCX to ``ucx`` and answers with UcxPosted)."""
    checksum: bool = True
    ucx: UcxTarget | None = None
    cma: CmaTarget | None = None


class LayerHeader(msgspec.Struct, tag="kv.layer.v1", frozen=True):
    transfer_id: str
    layer: int
    block_ids: list[int]
    """Remote block ids of the segments that follow, first block of each segment."""
    dtype: str
    shape: list[int]
    """Shape of one block of this layer (the engine's per-layer cache shape without its block axis)."""
    nbytes: list[int]
    """Bytes of each segment frame that follows."""
    checksums: list[int]
    """xxh3-64 of each segment's bytes, or empty when the pull asked for none."""


class End(msgspec.Struct, tag="kv.end.v1", frozen=True):
    transfer_id: str
    layers: int


class Grant(msgspec.Struct, tag="kv.grant.v1", frozen=True):
    """Shared-memory transport: read the blocks yourself from process ``pid`` (cross-memory attach)."""

    transfer_id: str
    pid: int
    layer_addresses: list[int]
    """Address of block 0 of each layer in the prefill process."""
    block_nbytes: list[int]
    checksums: list[list[int]]
    """Per layer, per segment; empty when the pull asked for none."""
    pushing: list[int] = []
    """Layers the prefill node is writing into the decode process itself (from ``Pull.cma``); a
    ``Pushed`` follows when they are in place. Empty: the decode node copies every layer."""


class Pushed(msgspec.Struct, tag="kv.pushed.v1", frozen=True):
    """Shared-memory transport: the layers a Grant listed as ``pushing`` are written (``ok``), or
    could not be (``reason``; the decode node then copies them itself)."""

    transfer_id: str
    ok: bool
    reason: str = ""


class UcxPosted(msgspec.Struct, tag="kv.ucx_posted.v1", frozen=True):
    """The prefill node has posted every UCX send of a ``ucx`` pull (its answer on the ZeroMQ socket)."""

    transfer_id: str
    dtype: str
    shape: list[int]
    checksums: list[list[int]]
    """xxh3-64 per layer, per segment; empty when the pull asked for none."""


class Done(msgspec.Struct, tag="kv.done.v1", frozen=True):
    transfer_id: str
    ok: bool
    reason: str = ""


class Release(msgspec.Struct, tag="kv.release.v1", frozen=True):
    transfer_id: str
    reason: str


class Reject(msgspec.Struct, tag="kv.reject.v1", frozen=True):
    transfer_id: str
    reason: str


class Query(msgspec.Struct, tag="kv.query.v1", frozen=True):
    """How did this lease's transfer go? (the router, after a streamed answer: vLLM returns the
    decode side's kv_transfer_params only on non-streamed ones)."""

    transfer_id: str


class LeaseReport(msgspec.Struct, tag="kv.lease_report.v1", frozen=True):
    """The prefill node's view of one transfer: from the Pull's arrival to the decode node's Done."""

    transfer_id: str
    state: str
    """The lease's state: ``done`` (delivered), ``failed``, ``released``, ``expired``, or a live state."""
    transport: str
    nbytes: int
    blocks: int
    start: float
    """Wall clock: the Pull arrived (0: never pulled)."""
    end: float
    """Wall clock: the lease ended (0: still live)."""
    reason: str = ""


class Fault(msgspec.Struct, tag="kv.fault.v1", frozen=True):
    """Arm a fault on a prefill node's server (only honoured when TANDEM_KV_FAULTS=1): ``corrupt``
    flips a byte in the next segment sent; ``stall`` stops the next transfer after its first layer
    until ``seconds`` pass; ``hold`` answers the next Pull only after ``seconds``; ``expire`` gives
    the next lease a deadline already past."""

    kind: str
    seconds: float = 0.0


class Ack(msgspec.Struct, tag="kv.ack.v1", frozen=True):
    ok: bool = True


Message = (Pull | LayerHeader | End | Grant | Pushed | UcxPosted | Done | Release | Reject | Query | LeaseReport
           | Fault | Ack)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    return _decoder.decode(data)


def segments_of(remote_ids: list[int], local_ids: list[int]) -> list[Segment]:
    """Pair remote and local block ids position by position and cut wherever either side stops being
    consecutive: the fewest contiguous copies that move them."""
    if len(remote_ids) != len(local_ids):
        raise ValueError(f"{len(remote_ids)} remote blocks for {len(local_ids)} local blocks")
    out: list[Segment] = []
    i = 0
    while i < len(remote_ids):
        j = i + 1
        while (j < len(remote_ids) and remote_ids[j] == remote_ids[j - 1] + 1
               and local_ids[j] == local_ids[j - 1] + 1):
            j += 1
        out.append(Segment(remote_ids[i], local_ids[i], j - i))
        i = j
    return out
