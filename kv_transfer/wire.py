"""The block wire format and the control messages between a decode node (which pulls) and a prefill
node (which holds the blocks under a lease and serves them).

Every message is a msgspec struct, tagged and versioned (``kv.<name>.v1``), msgpack-encoded, and sent
as the first ZeroMQ frame inside a signed envelope (``Codec``, below). Block data never goes through
msgpack: a ``LayerHeader`` frame is followed by one raw frame per segment (the bytes of ``count``
consecutive blocks of that layer, exactly as they lie in the engine's paged KV cache), so both ends can
send from and receive into the cache itself.

    decode (DEALER)                                prefill (ROUTER)
      Pull(transfer_id, segments, transport) ───▶  MAC checked, lease HELD → SENDING
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

    layer-wise (Pull.layerwise: the prefill is still computing; segments address prompt positions)
      Pull(layerwise, segments by position)  ───▶  lease FILLING → SENDING
                                             ◀───  Grant(pid, addresses)        (shm only, at once)
                                             ◀───  Filling(layers=0)            every keepalive_s while
                                                   the prefill has not reached a new layer (the
                                                   decode node's stall timer restarts on each)
                                             ◀───  Filling(layers=k, block_ids, checksums of the new
                                                   layers for shm) as the prefill writes layer k-1
                                                   of the last chunk; tcp/ipc: LayerHeader + frames
                                                   of each new layer follow it, End after the last
                                             ◀───  Reject("prefill ended ...")  the prefill failed or
                                                   was aborted half-way: the pull fails, nothing
                                                   stays leased
    router (DEALER)
      Query(transfer_id)                     ───▶
                                             ◀───  LeaseReport(state, bytes, start, end)  (the lake's
                                                   transfer fields for streamed answers)
    any peer
      a frame whose MAC does not verify      ───▶  counted, logged
                                             ◀───  Reject("", "unauthenticated: ...")  at once, so the
                                                   peer fails fast instead of waiting out its deadline
                                             ◀───  Reject(reason) instead of data: unknown/expired lease,
                                                   or a one-host transport asked by an unproven peer

The envelope (every control frame, both directions)::

    b"TKV2" | timestamp: uint64 big-endian, microseconds since the epoch | MAC: 32 bytes | msgpack body
    MAC = HMAC-SHA256(cluster secret, b"TKV2" + timestamp + body)

The MAC proves the sender holds the cluster secret (``auth.py`` says where it comes from); the
timestamp, under the MAC, bounds replays of a captured frame to ``MAX_SKEW_S`` either side of the
receiver's clock (transfer ids are single-use anyway, so a replay inside that window meets an ended
lease). Block data frames carry no MAC of their own: they are bound to their authenticated header by
its xxh3 checksums (see ``auth.py`` for what that does and does not cover).

``shm`` pulls are served only on the server's ``ipc://`` socket, to a peer whose Unix-socket
credentials (SO_PEERCRED) show the same uid and the very pid its ``CmaTarget`` names; anything else is
answered with a Reject. The decode side likewise reads only from the pid its ipc socket's peer proves.

Versions (``PROTOCOL``)
    1  plain msgpack frames, no authentication.
    2  every control frame in the signed envelope above; ``shm`` only over ipc with proven peer
       credentials. A v1 frame fails the MAC check and is answered with a Reject; a v1 peer cannot read
       v2 answers and fails at its deadline.

    2, later: ``Pull.layerwise``, ``Filling``. A Pull without ``layerwise`` is served as before, and
       only a puller that asks for layer-wise gets a ``Filling``, so peers of the earlier 2 still
       interoperate for whole pulls (msgspec skips a field it does not know, and the field defaults
       to off).

The check: the envelope's marker is the version (``TKV`` + the protocol number). ``Codec.decode`` reads
it before anything else, and a frame under another version's marker is a ``VersionMismatch`` naming
both; a block server answers it at once with ``Reject("", "version mismatch: ...")`` (``VERSION_REJECT``),
as it answers an authenticated frame it cannot decode with ``Reject("", "undecodable: ...")``, so the
peer fails fast instead of waiting out its deadline.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time

import msgspec

from contracts.errors import PeerUnauthenticated, UpstreamError, VersionMismatch

PROTOCOL = 2

MAGIC = b"TKV%d" % PROTOCOL
"""Envelope marker: the protocol version a frame was signed under."""
_MARKER = b"TKV"
VERSION_REJECT = "version mismatch"
"""How a Reject's reason starts when the peer speaks another protocol version."""
UNDECODABLE_REJECT = "undecodable"
"""How a Reject's reason starts when an authenticated frame is no message of this version."""
MAX_SKEW_S = 120.0
"""How far a frame's timestamp may lie from the receiver's clock (replay window and clock skew between
hosts, which NTP keeps far below this)."""
_MAC_BYTES = 32
_TS = struct.Struct(">Q")
_HEAD = len(MAGIC) + _TS.size + _MAC_BYTES


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
    layerwise: bool = False
    """Served while the prefill computes: each segment's ``remote`` is a position in the lease's block
    list (the decode node cannot know the block ids yet), and each layer is sent once the prefill has
    written it (``Filling``). tcp, ipc and shm only."""


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


class Filling(msgspec.Struct, tag="kv.filling.v1", frozen=True):
    """Layer-wise pulls: the prefill has written the first ``layers`` layers of every position asked.
    Also the heartbeat while it has not (same ``layers`` again): the decode node waits for as long
    as these keep coming, however long the prefill takes."""

    transfer_id: str
    layers: int
    block_ids: list[int] = []
    """The lease's block ids at the positions asked, in the Pull's order (empty until ``layers`` > 0)."""
    checksums: list[list[int]] = []
    """shm with checksums: per newly written layer, per segment of ``resolve(...)``."""


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
    """Arm a fault on a prefill node's server (only honoured when TANDEM_NODE_KV_FAULTS=1): ``corrupt``
    flips a byte in the next segment sent; ``stall`` stops the next transfer after its first layer
    until ``seconds`` pass; ``hold`` answers the next Pull only after ``seconds``; ``expire`` gives
    the next lease a deadline already past."""

    kind: str
    seconds: float = 0.0


class Ack(msgspec.Struct, tag="kv.ack.v1", frozen=True):
    ok: bool = True


Message = (
    Pull
    | LayerHeader
    | End
    | Grant
    | Pushed
    | Filling
    | UcxPosted
    | Done
    | Release
    | Reject
    | Query
    | LeaseReport
    | Fault
    | Ack
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class Codec:
    """Signs every message it encodes and verifies every frame it decodes, under one cluster secret.
    Thread-safe (no state beyond the key); one per process or per component is enough."""

    def __init__(self, secret: bytes, *, max_skew_s: float = MAX_SKEW_S) -> None:
        if not secret:
            raise ValueError("an empty cluster secret")
        self._key = secret
        self._max_skew_s = max_skew_s

    def encode(self, msg: Message) -> bytes:
        body = _encoder.encode(msg)
        stamp = _TS.pack(int(time.time() * 1e6))
        return b"".join((MAGIC, stamp, self._mac(stamp, body), body))

    def decode(self, data: bytes | memoryview) -> Message:
        """The message in ``data``; ``VersionMismatch`` for a frame under another protocol version's
        envelope; ``PeerUnauthenticated`` unless its MAC verifies and its timestamp is recent (nothing of
        an unverified frame is parsed, msgpack included); ``UpstreamError`` for a verified frame that is
        no message of this version."""
        view = memoryview(data)
        if len(view) >= len(MAGIC) and view[: len(_MARKER)] == _MARKER and view[: len(MAGIC)] != MAGIC:
            marker = bytes(view[len(_MARKER) : len(MAGIC)]).decode("ascii", "replace")
            raise VersionMismatch("KV wire protocol", theirs=int(marker) if marker.isdigit() else marker, ours=PROTOCOL)
        if len(view) < _HEAD or view[: len(MAGIC)] != MAGIC:
            raise PeerUnauthenticated("no signed envelope (an unauthenticated or protocol-1 peer)")
        stamp = view[len(MAGIC) : len(MAGIC) + _TS.size]
        mac = view[len(MAGIC) + _TS.size : _HEAD]
        body = view[_HEAD:]
        if not hmac.compare_digest(mac, self._mac(stamp, body)):
            raise PeerUnauthenticated("bad MAC (the peer holds another cluster secret, or the frame was altered)")
        skew = time.time() - _TS.unpack(stamp)[0] / 1e6
        if abs(skew) > self._max_skew_s:
            raise PeerUnauthenticated(
                f"frame timestamp {skew:+.0f} s off this host's clock (replayed, or clocks out of step)"
            )
        try:
            return _decoder.decode(body)
        except msgspec.DecodeError as exc:  # authenticated, yet not a message this version knows
            raise UpstreamError(f"{UNDECODABLE_REJECT} message from an authenticated peer: {exc}") from exc

    def _mac(self, stamp: bytes | memoryview, body: bytes | memoryview) -> bytes:
        h = hmac.new(self._key, MAGIC, hashlib.sha256)
        h.update(stamp)
        h.update(body)
        return h.digest()


def segments_of(remote_ids: list[int], local_ids: list[int]) -> list[Segment]:
    """Pair remote and local block ids position by position and cut wherever either side stops being
    consecutive: the fewest contiguous copies that move them."""
    if len(remote_ids) != len(local_ids):
        raise ValueError(f"{len(remote_ids)} remote blocks for {len(local_ids)} local blocks")
    out: list[Segment] = []
    i = 0
    while i < len(remote_ids):
        j = i + 1
        while j < len(remote_ids) and remote_ids[j] == remote_ids[j - 1] + 1 and local_ids[j] == local_ids[j - 1] + 1:
            j += 1
        out.append(Segment(remote_ids[i], local_ids[i], j - i))
        i = j
    return out


def positions_of(segments: list[Segment]) -> tuple[list[int], list[int]]:
    """A layer-wise pull's (remote positions, local block ids), block by block."""
    remote: list[int] = []
    local: list[int] = []
    for seg in segments:
        remote.extend(range(seg.remote, seg.remote + seg.count))
        local.extend(range(seg.local, seg.local + seg.count))
    return remote, local


def resolve(segments: list[Segment], block_ids: list[int]) -> list[Segment]:
    """A layer-wise pull's segments with block ids for positions: ``block_ids`` are the lease's ids at
    the positions asked, in order (``Filling.block_ids``). Both ends cut them the same way."""
    _, local = positions_of(segments)
    return segments_of(block_ids, local)
