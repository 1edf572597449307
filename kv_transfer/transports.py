"""Data transports for a pull, behind one small interface. Control always goes over the pull's
ZeroMQ socket (tcp across hosts, ipc on one host); the data either follows on that socket as raw
frames received straight into the destination blocks (``FrameTransport``: ``tcp``, ``ipc``), or is
copied by the decode process out of the prefill process's memory with one kernel copy
(``CmaTransport``: ``shm``, Linux cross-memory attach, ``process_vm_readv``).

``receive`` raises ``TransferFailed`` with a reason on anything that is not a complete, verified copy,
and on any answer whose MAC does not verify under the cluster secret (``wire.Codec``). ``shm`` reads
only from the process its ipc socket's kernel credentials prove to be the prefill node (the Grant's
pid is checked against them), never over tcp.

``shm`` copies while the Grant is in flight (``KnownPeer``): a prefill process's pid and cache addresses
never change while it lives, so once one Grant on an endpoint has proven them, the next pull to that
endpoint reads its own share of the layers right after sending the Pull, beside the prefill node's
answer instead of after it. That is as safe as the copy after the Grant: the prefill blocks are
immutable from the prefill's end (they are delay-freed, then leased) until the lease ends, and a lease
that ended answers with a Reject, which fails the pull and sends its local blocks to recompute. The
bytes read early are kept only if this pull's Grant, from the socket's proven peer, names the same
pid and addresses; otherwise (the prefill node restarted) they are read again from the proven one. A
pid is taken for the same process only with the same start time (``/proc/<pid>/stat``), so a reused
pid is never read from. Once proven, the process is held by a pidfd (``ProcessHandle``): whether it
still lives is then one poll, not a read of ``/proc`` per check (two per pull).
"""

from __future__ import annotations

import ctypes
import os
import select
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import zmq

from contracts.errors import PeerUnauthenticated, UpstreamError, VersionMismatch
from kv_transfer import wire
from kv_transfer.auth import peer_credentials
from kv_transfer.config import LAYERWISE_TRANSPORTS, TransportName
from kv_transfer.layout import KVLayout, checksum


class TransferFailed(Exception):
    """The pull did not deliver every block intact; ``reason`` says why (it travels in Done/metrics)."""

    def __init__(self, reason: str, *, refused: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused
        """The prefill node said no (unknown/expired lease): nothing to acknowledge."""


class Transport(Protocol):
    name: str

    def pull(self, transfer_id: str, segments: list[wire.Segment], checksum: bool, layout: KVLayout) -> wire.Pull:
        """The Pull message that asks the prefill node for ``segments`` over this transport."""
        ...

    def receive(
        self, sock: zmq.Socket[bytes], pull: wire.Pull, layout: KVLayout, deadline: float, *, codec: wire.Codec
    ) -> int:
        """Receive every segment of ``pull`` into ``layout``; returns the bytes moved. ``codec``
        verifies every control frame from the prefill node."""
        ...


def verify_answer(codec: wire.Codec, data: bytes | memoryview) -> wire.Message:
    """A prefill node's answer, verified: ``TransferFailed`` for one that fails authentication
    (refused: the node would not take our Done either) or that this version cannot read."""
    try:
        return codec.decode(data)
    except PeerUnauthenticated as exc:
        raise TransferFailed(
            f"answer failed authentication (is the cluster secret the same on both nodes?): {exc.message}", refused=True
        ) from exc
    except VersionMismatch as exc:  # the prefill node runs another release: it would not take our Done
        raise TransferFailed(exc.message, refused=True) from exc
    except UpstreamError as exc:
        raise TransferFailed(exc.message) from exc


def _recv_frame(sock: zmq.Socket[bytes], deadline: float, codec: wire.Codec) -> tuple[wire.Message, zmq.Frame]:
    left_ms = int((deadline - time.monotonic()) * 1000)
    if left_ms <= 0 or not sock.poll(left_ms):
        raise TransferFailed("timed out waiting for the prefill node")
    frame = sock.recv(copy=False)
    msg = verify_answer(codec, frame.buffer)
    if isinstance(msg, wire.Reject):
        raise TransferFailed(f"prefill node refused: {msg.reason}", refused=True)
    return msg, frame


def _recv_msg(sock: zmq.Socket[bytes], deadline: float, codec: wire.Codec) -> wire.Message:
    return _recv_frame(sock, deadline, codec)[0]


def _drain(sock: zmq.Socket[bytes]) -> None:
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv()


class FrameTransport:
    """Blocks as raw ZeroMQ frames, each received into its destination range (``recv_into``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def pull(self, transfer_id: str, segments: list[wire.Segment], checksum: bool, layout: KVLayout) -> wire.Pull:
        return wire.Pull(transfer_id, segments, self.name, checksum)

    def receive(
        self, sock: zmq.Socket[bytes], pull: wire.Pull, layout: KVLayout, deadline: float, *, codec: wire.Codec
    ) -> int:
        total = 0
        seen = 0
        while True:
            msg = _recv_msg(sock, deadline, codec)
            if isinstance(msg, wire.End):
                if msg.transfer_id != pull.transfer_id:
                    continue  # the tail of an earlier, abandoned pull on this socket
                if seen != layout.num_layers:
                    raise TransferFailed(f"got {seen} of {layout.num_layers} layers")
                return total
            if not isinstance(msg, wire.LayerHeader) or msg.transfer_id != pull.transfer_id:
                _drain(sock)
                continue
            if msg.dtype != layout.dtype or msg.shape != layout.block_shape:
                _drain(sock)
                raise TransferFailed(
                    f"layout mismatch: remote {msg.dtype}{msg.shape}, local {layout.dtype}{layout.block_shape}"
                )
            total += _receive_layer(sock, msg, pull.segments, layout)
            seen += 1


def _receive_layer(
    sock: zmq.Socket[bytes], msg: wire.LayerHeader, segments: list[wire.Segment], layout: KVLayout
) -> int:
    """The raw frames after one LayerHeader, each into its destination blocks, verified; bytes moved."""
    total = 0
    for i, seg in enumerate(segments):
        if not sock.getsockopt(zmq.RCVMORE):
            raise TransferFailed(f"layer {msg.layer}: {i} of {len(segments)} segments")
        dest = layout.span(msg.layer, seg.local, seg.count)
        n = sock.recv_into(cast(Any, dest))  # an ndarray is a writable buffer
        if n != dest.nbytes:
            _drain(sock)
            raise TransferFailed(f"layer {msg.layer} segment {i}: {n} bytes, expected {dest.nbytes}")
        if msg.checksums and checksum(dest) != msg.checksums[i]:
            _drain(sock)
            raise TransferFailed(f"bad checksum in layer {msg.layer} segment {i}")
        total += n
    _drain(sock)
    return total


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_IOV_MAX = 1024
_libc = ctypes.CDLL(None, use_errno=True)


def process_vm_readv(pid: int, pairs: list[tuple[int, int, int]]) -> None:
    """Copy (local address, remote address, nbytes) ranges out of process ``pid``."""
    _cma(_libc.process_vm_readv, "process_vm_readv", pid, pairs)


def process_vm_writev(pid: int, pairs: list[tuple[int, int, int]]) -> None:
    """Copy (local address, remote address, nbytes) ranges into process ``pid``."""
    _cma(_libc.process_vm_writev, "process_vm_writev", pid, pairs)


def _cma(call: Callable[..., int], name: str, pid: int, pairs: list[tuple[int, int, int]]) -> None:
    # ctypes releases the GIL around the call: the copy runs beside the engine's Python threads.
    for i in range(0, len(pairs), _IOV_MAX):
        chunk = pairs[i : i + _IOV_MAX]
        local = (_IoVec * len(chunk))(*[_IoVec(la, n) for la, _, n in chunk])
        remote = (_IoVec * len(chunk))(*[_IoVec(ra, n) for _, ra, n in chunk])
        want = sum(n for _, _, n in chunk)
        got = call(pid, local, len(chunk), remote, len(chunk), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise TransferFailed(f"{name} with pid {pid}: errno {err} ({os.strerror(err)})")
        if got != want:  # partial copies happen only at unmapped pages: the other side's memory is gone
            raise TransferFailed(f"{name} copied {got} of {want} bytes")


def cma_pairs(
    pull: wire.Pull,
    layers: list[int],
    here: Sequence[int],
    there: Sequence[int],
    block_nbytes: int,
    *,
    local_is_remote_side: bool,
) -> list[tuple[int, int, int]]:
    """(address here, address there, nbytes) of ``layers`` of a pull's segments. ``here``/``there``:
    block-0 addresses per layer; the prefill process sees segments' ``remote`` ids as its own."""
    out = []
    for layer in layers:
        for s in pull.segments:
            mine, theirs = (s.remote, s.local) if local_is_remote_side else (s.local, s.remote)
            out.append(
                (here[layer] + mine * block_nbytes, there[layer] + theirs * block_nbytes, s.count * block_nbytes)
            )
    return out


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of process ``pid`` (clock ticks since boot), or None when there is no
    such process: with the pid, it names one process for the machine's uptime (pids are reused)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[19])  # field 22 of proc(5); the first field after the name is field 3


class ProcessHandle:
    """A pidfd (``os.pidfd_open``): a handle on one process, not on its pid. It turns readable when
    that process exits, and while it has not, its pid names no other process. The descriptor is
    closed when the last holder lets go of the handle, never while one could still poll it (an fd
    closed under a poller could be reused by another file and answer for it)."""

    def __init__(self, pid: int) -> None:
        self.fd = os.pidfd_open(pid)

    @classmethod
    def open(cls, pid: int) -> ProcessHandle | None:
        """None when there is no such process, or no pidfd on this kernel (checks then read /proc)."""
        try:
            return cls(pid)
        except (OSError, AttributeError):
            return None

    def exited(self) -> bool:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(0))

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass  # never opened, or the interpreter is shutting down


@dataclass(frozen=True)
class KnownPeer:
    """What a proven Grant said that does not change while the prefill process lives. Two are equal
    when they name the same process (pid and start time) and cache addresses, whatever their handle."""

    pid: int
    start_time: int
    layer_addresses: tuple[int, ...]
    handle: ProcessHandle | None = field(default=None, compare=False, repr=False)
    """A pidfd on the process (None: checks read /proc)."""

    @classmethod
    def prove(cls, pid: int, layer_addresses: Sequence[int], known: KnownPeer | None) -> KnownPeer | None:
        """The peer that a Grant from the socket's proven ``pid`` names; None when that process is gone.
        ``known`` itself (its handle kept, nothing read) when it is that very process and unchanged."""
        addresses = tuple(layer_addresses)
        if known is not None and known.pid == pid and known.alive():
            return known if known.layer_addresses == addresses else cls(pid, known.start_time, addresses, known.handle)
        handle = ProcessHandle.open(pid)  # first: what is read next is this process's if it still lives after
        start_time = process_start_time(pid)
        if start_time is None or (handle is not None and handle.exited()):
            return None
        return cls(pid, start_time, addresses, handle)

    def alive(self) -> bool:
        """The very process that was proven (not a newer one under a reused pid)."""
        if self.handle is not None:
            return not self.handle.exited()
        return process_start_time(self.pid) == self.start_time


class CmaTransport:
    """One host: the prefill node answers with a Grant (its pid and cache addresses) and this process
    copies the leased blocks straight into its own cache with one kernel copy. With ``split``, the
    prefill node writes half of the layers into this process meanwhile (``process_vm_writev``), so the
    copy runs on both nodes' cores at once; if it cannot, this side copies those layers too.

    ``known``: the peer an earlier Grant on this endpoint proved; this side's layers are then read
    before the Grant arrives (module docstring). ``learned``, after ``receive``: this pull's proven
    peer, for the next pull."""

    name = TransportName.SHM.value

    def __init__(self, split: bool = True, known: KnownPeer | None = None) -> None:
        self.split = split
        self.known = known
        self.learned: KnownPeer | None = None
        self.early = False
        """Whether this pull's copy started before its Grant (and was kept)."""

    def pull(self, transfer_id: str, segments: list[wire.Segment], checksum: bool, layout: KVLayout) -> wire.Pull:
        return wire.Pull(transfer_id, segments, self.name, checksum, cma=self.target(layout))

    def target(self, layout: KVLayout) -> wire.CmaTarget:
        n = layout.num_layers
        return wire.CmaTarget(
            os.getpid(),
            list(layout.addresses),
            layout.block_nbytes,
            layout.layers[0].shape[0],
            list(range(n // 2)) if self.split else [],
        )

    def receive(
        self, sock: zmq.Socket[bytes], pull: wire.Pull, layout: KVLayout, deadline: float, *, codec: wire.Codec
    ) -> int:
        bn = layout.block_nbytes
        here = layout.addresses
        asked = set(pull.cma.push_layers) if pull.cma is not None else set()
        early = [layer for layer in range(layout.num_layers) if layer not in asked]
        read_early = self._read_early(pull, early, here, bn)
        # Read only from the process that holds the other end of this Unix socket (the kernel says
        # which), whatever pid the Grant names: never from a process that a message alone names.
        msg = _proven_grant(*_recv_frame(sock, deadline, codec), pull, layout)
        proven = KnownPeer.prove(msg.pid, msg.layer_addresses, self.known)
        if proven is None:
            raise TransferFailed(f"the prefill process {msg.pid} is gone")
        self.early = read_early and proven == self.known
        copied = set(early) if self.early else set()
        pushing = set(msg.pushing)
        mine = [layer for layer in range(layout.num_layers) if layer not in pushing and layer not in copied]
        process_vm_readv(msg.pid, cma_pairs(pull, mine, here, msg.layer_addresses, bn, local_is_remote_side=False))
        if pushing:
            done = _recv_msg(sock, deadline, codec)
            if not isinstance(done, wire.Pushed) or done.transfer_id != pull.transfer_id:
                raise TransferFailed(f"expected Pushed, got {type(done).__name__}")
            if not done.ok:  # the prefill node could not write: copy its share from here
                process_vm_readv(
                    msg.pid, cma_pairs(pull, sorted(pushing), here, msg.layer_addresses, bn, local_is_remote_side=False)
                )
        if msg.checksums:
            for layer in range(layout.num_layers):
                for i, s in enumerate(pull.segments):
                    if checksum(layout.span(layer, s.local, s.count)) != msg.checksums[layer][i]:
                        raise TransferFailed(f"bad checksum in layer {layer} segment {i}")
        self.learned = proven
        return layout.nbytes(pull.segments)

    def _read_early(self, pull: wire.Pull, layers: list[int], here: Sequence[int], block_nbytes: int) -> bool:
        """Copy ``layers`` from the known peer before its Grant comes; whether that was done. Any
        failure only means the copy waits for the Grant, as without a known peer."""
        known = self.known
        if known is None or len(known.layer_addresses) != len(here) or not known.alive():
            return False
        pairs = cma_pairs(pull, layers, here, known.layer_addresses, block_nbytes, local_is_remote_side=False)
        try:
            process_vm_readv(known.pid, pairs)
        except TransferFailed:
            return False
        return True


def _proven_grant(msg: wire.Message, frame: zmq.Frame, pull: wire.Pull, layout: KVLayout) -> wire.Grant:
    """A Grant for this pull, from the process its socket's kernel credentials prove, for this layout."""
    if not isinstance(msg, wire.Grant) or msg.transfer_id != pull.transfer_id:
        raise TransferFailed(f"expected a Grant, got {type(msg).__name__}")
    peer = peer_credentials(frame)
    if peer is None or peer.pid != msg.pid:
        raise TransferFailed(
            f"Grant names pid {msg.pid}, but the socket's proven peer is "
            f"{'pid ' + str(peer.pid) if peer else 'unknown (not an ipc socket)'}"
        )
    if len(msg.layer_addresses) != layout.num_layers or any(b != layout.block_nbytes for b in msg.block_nbytes):
        raise TransferFailed("layout mismatch between prefill and decode caches")
    return msg


class LayerwiseTransport:
    """A layer-wise pull (``wire.Pull.layerwise``), asked before or while the prefill computes: each
    ``Filling`` says how many layers are written and restarts the stall timer (``stall_s``), so the
    pull waits as long as the prefill takes but fails ``stall_s`` after the prefill node goes quiet.
    tcp/ipc: each layer's frames follow as on a whole pull. shm: the Grant comes first, and this side
    copies every layer itself as it is announced (the prefill node's core is computing)."""

    def __init__(
        self,
        name: str,
        stall_s: float,
        on_layers: Callable[[int], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        if name not in LAYERWISE_TRANSPORTS:
            raise ValueError(f"no layer-wise pull over {name!r} (tcp, ipc, shm)")
        self.name = name
        self.stall_s = stall_s
        self.first_layer_at: float | None = None
        """monotonic: when the first layer arrived (or was announced, for shm)."""
        self.on_layers = on_layers
        """Told the count of leading layers in place each time it grows (a split prefill's gate)."""
        self.cancelled = cancelled
        """Checked before each layer is written: a pull given up (a split's stall) must not write into
        blocks its engine recomputes, or frees and gives to another request."""
        self._ready = 0

    def _progress(self, done: set[int]) -> None:
        ready = self._ready
        while ready in done:
            ready += 1
        if ready != self._ready:
            self._ready = ready
            if self.on_layers is not None:
                self.on_layers(ready)

    def pull(self, transfer_id: str, segments: list[wire.Segment], checksum: bool, layout: KVLayout) -> wire.Pull:
        return wire.Pull(transfer_id, segments, self.name, checksum, layerwise=True)

    def receive(
        self, sock: zmq.Socket[bytes], pull: wire.Pull, layout: KVLayout, deadline: float, *, codec: wire.Codec
    ) -> int:
        n = layout.num_layers
        grant = None
        if self.name == TransportName.SHM:
            grant = _proven_grant(*_recv_frame(sock, deadline, codec), pull, layout)
        here = layout.addresses
        positions, _ = wire.positions_of(pull.segments)
        segments: list[wire.Segment] | None = None
        done: set[int] = set()
        while True:
            msg = _recv_msg(sock, deadline, codec)
            if getattr(msg, "transfer_id", pull.transfer_id) != pull.transfer_id:
                _drain(sock)
                continue  # the tail of an earlier, abandoned pull on this socket
            if self.cancelled():
                _drain(sock)
                raise TransferFailed("cancelled")
            if isinstance(msg, wire.Filling):
                deadline = max(deadline, time.monotonic() + self.stall_s)
                if msg.layers and segments is None:
                    if len(msg.block_ids) != len(positions):
                        raise TransferFailed(f"{len(msg.block_ids)} block ids for {len(positions)} positions")
                    segments = wire.resolve(pull.segments, msg.block_ids)
                if grant is not None and segments is not None:
                    new = [layer for layer in range(min(msg.layers, n)) if layer not in done]
                    if new:
                        self.first_layer_at = self.first_layer_at or time.monotonic()
                        process_vm_readv(
                            grant.pid,
                            cma_pairs(
                                wire.Pull(pull.transfer_id, segments, TransportName.SHM.value),
                                new,
                                here,
                                grant.layer_addresses,
                                layout.block_nbytes,
                                local_is_remote_side=False,
                            ),
                        )
                        for k, layer in enumerate(new):
                            if msg.checksums:
                                for i, seg in enumerate(segments):
                                    if checksum(layout.span(layer, seg.local, seg.count)) != msg.checksums[k][i]:
                                        raise TransferFailed(f"bad checksum in layer {layer} segment {i}")
                            done.add(layer)
                        self._progress(done)
                    if len(done) == n:
                        return layout.nbytes(pull.segments)
            elif isinstance(msg, wire.LayerHeader) and grant is None:
                if segments is None or not 0 <= msg.layer < n or msg.layer in done:
                    _drain(sock)
                    raise TransferFailed(f"layer {msg.layer} out of order")
                if msg.dtype != layout.dtype or msg.shape != layout.block_shape:
                    _drain(sock)
                    raise TransferFailed(
                        f"layout mismatch: remote {msg.dtype}{msg.shape}, local {layout.dtype}{layout.block_shape}"
                    )
                self.first_layer_at = self.first_layer_at or time.monotonic()
                _receive_layer(sock, msg, segments, layout)
                done.add(msg.layer)
                self._progress(done)
            elif isinstance(msg, wire.End) and grant is None:
                if len(done) != n:
                    raise TransferFailed(f"got {len(done)} of {n} layers")
                return layout.nbytes(pull.segments)
            else:
                _drain(sock)


def transport_for(name: str, *, shm_split: bool = True, known: KnownPeer | None = None) -> Transport:
    if name in (TransportName.TCP, TransportName.IPC):
        return FrameTransport(name)
    if name == TransportName.SHM:
        return CmaTransport(split=shm_split, known=known)
    raise ValueError(f"unknown transport {name!r} (tcp, ipc, shm; ucx is the puller's own)")
