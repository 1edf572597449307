"""Sending a pull's blocks, by the transport the pull names: frames over the ZeroMQ socket it came in on
(tcp, ipc), a ``Grant`` of this process's cache addresses that the decode node copies from itself, with
this side pushing its share meanwhile when the target allows (shm), or a UCX send (ucx).

``serve`` checks a whole pull's segments against its lease and moves the lease through SENDING to
AWAIT_ACK (or back to HELD when a send fails); ``send_layer`` is also what the layer-wise streams send
each layer with (``layer_streams``). It remembers what it served of recent pulls (``SERVED_KEPT``) for
the router's ``Query`` (``report``). The armed ``corrupt`` and ``stall`` faults act here."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import zmq

from kv_transfer import wire
from kv_transfer.config import TransportName
from kv_transfer.layout import KVLayout, checksum
from kv_transfer.transports import TransferFailed, cma_pairs, process_vm_writev
from prefill_nodes.lease import LeaseError, LeaseState, LeaseTable

if TYPE_CHECKING:
    from kv_transfer.ucx import UcxSender

log = logging.getLogger("tandem.kv.server")

SERVED_KEPT = 10_000
"""Recent pulls remembered for ``Query`` (a router asks right after a streamed answer ends)."""


class BlockSender:
    """Sends pulls' blocks from ``layout``; used only on the block server's thread."""

    def __init__(
        self,
        layout: KVLayout,
        leases: LeaseTable,
        codec: wire.Codec,
        armed: dict[str, float],
        stop: threading.Event,
    ) -> None:
        self.layout = layout
        self.leases = leases
        self.codec = codec
        self._armed = armed
        """The block server's armed faults (kind -> seconds), shared: a fault fires once, wherever it acts."""
        self._stop = stop
        """Set when the server closes: a stall fault ends with it."""
        self._served: dict[str, tuple[str, int, int, float]] = {}
        """transfer id → (transport, bytes, blocks, wall-clock start) of recent pulls, for Query."""
        self._ucx: UcxSender | None = None
        """UcxSender, started at the first ``ucx`` pull (importing ucxx costs seconds; most nodes never
        need it)."""

    def close(self) -> None:
        if self._ucx is not None:
            self._ucx.close()

    def reply(self, sock: zmq.Socket[bytes], ident: bytes, msg: wire.Message) -> None:
        sock.send_multipart([ident, self.codec.encode(msg)])

    def serve(self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull) -> None:
        """Serve a whole pull of a HELD lease: its segments checked against the lease, then sent by its
        transport; the lease waits for the decode node's Done (AWAIT_ACK), or is HELD again if sending
        failed."""
        tid = pull.transfer_id
        lease = self.leases.get(tid)
        if lease is None or lease.state is not LeaseState.HELD:
            self.reply(sock, ident, wire.Reject(tid, f"lease is {lease.state if lease else 'gone'}"))
            return
        nblocks = self.layout.layers[0].shape[0]
        leased = set(lease.block_ids)
        for s in pull.segments:
            if (
                s.count <= 0
                or s.remote < 0
                or s.remote + s.count > nblocks
                or any(b not in leased for b in range(s.remote, s.remote + s.count))
            ):
                self.reply(sock, ident, wire.Reject(tid, f"segment {s} is outside the lease"))
                return
        if not self.begin_sending(sock, ident, pull):
            return
        try:
            if pull.transport == TransportName.SHM:
                self._grant(sock, ident, pull)
            elif pull.transport == TransportName.UCX:
                if not self._send_ucx(sock, ident, pull):
                    return
            else:
                self._send_frames(sock, ident, pull)
        except (zmq.ZMQError, OSError) as exc:
            log.warning("sending %s failed: %s", tid, exc)
            self.leases.move(tid, LeaseState.HELD, f"send failed: {exc}")
            return
        if self.leases.get(tid) is not None:
            self.leases.move(tid, LeaseState.AWAIT_ACK)

    def begin_sending(self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull) -> bool:
        """Move the lease to SENDING and note what is served (for the router's later Query); False, with
        a Reject sent, when the engine thread ended the lease (abort_fill) since the caller's check."""
        tid = pull.transfer_id
        try:
            self.leases.move(tid, LeaseState.SENDING)
        except LeaseError as exc:
            self.reply(sock, ident, wire.Reject(tid, f"lease ended: {exc}"))
            return False
        self._served[tid] = (
            pull.transport,
            self.layout.nbytes(pull.segments),
            sum(s.count for s in pull.segments),
            time.time(),
        )
        if len(self._served) > SERVED_KEPT:
            del self._served[next(iter(self._served))]
        return True

    def _send_frames(self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull) -> None:
        lay = self.layout
        for layer in range(lay.num_layers):
            self.send_layer(sock, ident, pull, layer, pull.segments)
        sock.send_multipart([ident, self.codec.encode(wire.End(pull.transfer_id, lay.num_layers))])

    def send_layer(
        self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull, layer: int, segments: list[wire.Segment]
    ) -> None:
        lay = self.layout
        spans = [lay.span(layer, s.remote, s.count) for s in segments]
        sums = [checksum(v) for v in spans] if pull.checksum else []
        if "corrupt" in self._armed and spans:
            self._armed.pop("corrupt")
            bad = spans[0].copy()
            bad[len(bad) // 2] ^= 0xFF
            spans[0] = bad
        header = wire.LayerHeader(
            pull.transfer_id,
            layer,
            [s.remote for s in segments],
            lay.dtype,
            lay.block_shape,
            [v.nbytes for v in spans],
            sums,
        )
        sock.send_multipart([ident, self.codec.encode(header), *cast(list[Any], spans)], copy=False)
        if layer == 0 and "stall" in self._armed:
            self._stall(self._armed.pop("stall"))

    def _stall(self, seconds: float) -> None:
        log.warning("fault injection: stalling a transfer for %.1f s", seconds)
        self._stop.wait(seconds)

    def _send_ucx(self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull) -> bool:
        """Post the pull's blocks over UCX; False (lease FAILED, pull refused) if that cannot be done."""
        from kv_transfer.ucx import UcxError, UcxSender

        try:
            if pull.ucx is None:
                raise UcxError("a ucx pull without a UCX target")
            if self._ucx is None:
                self._ucx = UcxSender(self.layout)
            posted = self._ucx.send(pull, pull.ucx, corrupt=self._armed.pop("corrupt", None) is not None)
        except UcxError as exc:
            # Refused pulls get no Done from the decode side: end the lease here.
            self.leases.move(pull.transfer_id, LeaseState.FAILED, f"ucx: {exc}")
            self.reply(sock, ident, wire.Reject(pull.transfer_id, f"ucx: {exc}"))
            return False
        self.reply(sock, ident, posted)
        return True

    def _grant(self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull) -> None:
        lay = self.layout
        sums = (
            [[checksum(lay.span(layer, s.remote, s.count)) for s in pull.segments] for layer in range(lay.num_layers)]
            if pull.checksum
            else []
        )
        here = list(lay.addresses)
        target = pull.cma
        push: list[int] = []
        if (
            target is not None
            and target.block_nbytes == lay.block_nbytes
            and len(target.layer_addresses) == lay.num_layers
            and all(s.local >= 0 and s.local + s.count <= target.num_blocks for s in pull.segments)
        ):
            push = sorted({i for i in target.push_layers if 0 <= i < lay.num_layers})
        self.reply(
            sock,
            ident,
            wire.Grant(pull.transfer_id, os.getpid(), here, [lay.block_nbytes] * lay.num_layers, sums, push),
        )
        if not push:
            return
        # The decode node is copying its share already; write ours into it meanwhile (on this core).
        assert target is not None
        try:
            process_vm_writev(
                target.pid,
                cma_pairs(pull, push, here, target.layer_addresses, lay.block_nbytes, local_is_remote_side=True),
            )
        except TransferFailed as exc:
            log.warning("shm push of %s failed, the decode node copies it: %s", pull.transfer_id, exc.reason)
            self.reply(sock, ident, wire.Pushed(pull.transfer_id, False, exc.reason))
            return
        self.reply(sock, ident, wire.Pushed(pull.transfer_id, True))

    def report(self, tid: str) -> wire.Message:
        """The answer to a ``Query``: the lease's state and what was served of it."""
        transport, nbytes, blocks, start = self._served.get(tid, ("", 0, 0, 0.0))
        lease = self.leases.get(tid)
        if lease is not None:
            return wire.LeaseReport(tid, lease.state.value, transport, nbytes, blocks, start, 0.0, lease.reason)
        ended = self.leases.ended_info(tid)
        if ended is None:
            return wire.Reject(tid, "unknown lease")
        state, end, reason = ended
        return wire.LeaseReport(tid, state.value, transport, nbytes, blocks, start, end or 0.0, reason)

    def forget(self, tid: str) -> None:
        """Drop what the UCX sender keeps of an ended lease."""
        if self._ucx is not None:
            self._ucx.forget(tid)
