"""Layer-wise pulls (``Pull.layerwise``), served while the prefill computes: the engine thread opens the
lease before the prefill (``BlockServer.open_fill``) and reports each layer as it is written (``fill``,
from ``save_kv_layer``); the block server's thread keeps one ``Stream`` per such pull and, whenever it
wakes, sends what the prefill has written since (``Filling`` and, for tcp/ipc, the layers' frames), a
heartbeat every ``keepalive_s`` while nothing new is there, and a Reject if the prefill failed or was
aborted (``abort_fill``), which ends the lease at once. The last layer sent, the lease waits for the
decode node's Done (AWAIT_ACK)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import zmq

from kv_transfer import wire
from kv_transfer.config import LAYERWISE_TRANSPORTS, TransportName
from kv_transfer.layout import checksum
from prefill_nodes.block_sender import BlockSender
from prefill_nodes.lease import LeaseError, LeaseState

log = logging.getLogger("tandem.kv.server")

KEEPALIVE_S = 1.0
"""How often a layer-wise stream tells its decode node the prefill is still computing (its stall
timeout, ``transfer_timeout_s``, must be longer)."""


@dataclass
class Stream:
    """A layer-wise pull being served as the prefill writes its layers."""

    sock: zmq.Socket[bytes]
    ident: bytes
    pull: wire.Pull
    last: float
    """monotonic: the last message sent on it."""
    sent: int = 0
    """Layers announced (and, for tcp/ipc, sent)."""
    block_ids: list[int] | None = None
    """The lease's block ids at the positions asked, once known."""
    segments: list[wire.Segment] | None = None


class LayerStreams:
    """The layer-wise pulls being served; used only on the block server's thread."""

    def __init__(self, sender: BlockSender, keepalive_s: float = KEEPALIVE_S) -> None:
        self.sender = sender
        self.layout = sender.layout
        self.leases = sender.leases
        self.codec = sender.codec
        self.keepalive_s = keepalive_s
        self._streams: dict[str, Stream] = {}

    def next_wakes(self) -> list[float]:
        """Monotonic times at which a stream is due a heartbeat."""
        return [st.last + self.keepalive_s for st in self._streams.values()]

    def advance_all(self) -> None:
        for tid in list(self._streams):
            self.advance(tid)

    def open(self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull) -> None:
        """Start serving a layer-wise pull of a FILLING or HELD lease (shm: the Grant of the cache
        addresses first), and send it what is written already."""
        tid = pull.transfer_id
        lease = self.leases.get(tid)
        if lease is None or lease.state not in (LeaseState.FILLING, LeaseState.HELD):
            self.sender.reply(sock, ident, wire.Reject(tid, f"lease is {lease.state if lease else 'gone'}"))
            return
        if pull.transport not in LAYERWISE_TRANSPORTS or any(s.count <= 0 or s.remote < 0 for s in pull.segments):
            self.sender.reply(
                sock, ident, wire.Reject(tid, f"not a layer-wise pull this server serves ({pull.transport})")
            )
            return
        if not self.sender.begin_sending(sock, ident, pull):
            return
        lay = self.layout
        if pull.transport == TransportName.SHM:  # the decode node copies every layer itself: this core computes
            here = list(lay.addresses)
            self.sender.reply(sock, ident, wire.Grant(tid, os.getpid(), here, [lay.block_nbytes] * lay.num_layers, []))
        self._streams[tid] = Stream(sock, ident, pull, time.monotonic())
        self.advance(tid)

    def advance(self, tid: str) -> None:
        """Send a stream what its prefill has written since it last looked, a heartbeat when nothing,
        or a Reject when the lease ended under it (the prefill failed, or the decode node said Done)."""
        st = self._streams[tid]
        lease = self.leases.get(tid)
        if lease is None:
            del self._streams[tid]
            info = self.leases.ended_info(tid)
            state, reason = (info[0].value, info[2]) if info else ("gone", "")
            self.sender.reply(st.sock, st.ident, wire.Reject(tid, f"lease {state}: {reason}"))
            return
        lay, pull = self.layout, st.pull
        ready = lay.num_layers if lease.layers_ready is None else min(lease.layers_ready, lay.num_layers)
        now = time.monotonic()
        try:
            if ready > st.sent:
                if st.segments is None:
                    positions, _ = wire.positions_of(pull.segments)
                    nblocks = lay.layers[0].shape[0]
                    if any(p >= len(lease.block_ids) for p in positions) or any(
                        not 0 <= lease.block_ids[p] < nblocks for p in positions
                    ):
                        del self._streams[tid]
                        self.leases.move(tid, LeaseState.FAILED, "layer-wise pull asks positions outside the lease")
                        self.sender.reply(st.sock, st.ident, wire.Reject(tid, "positions outside the lease"))
                        return
                    st.block_ids = [lease.block_ids[p] for p in positions]
                    st.segments = wire.resolve(pull.segments, st.block_ids)
                ids, segments = st.block_ids or [], st.segments or []  # both set together, just above
                new = range(st.sent, ready)
                sums = (
                    [[checksum(lay.span(layer, s.remote, s.count)) for s in segments] for layer in new]
                    if pull.checksum and pull.transport == TransportName.SHM
                    else []
                )
                self.sender.reply(st.sock, st.ident, wire.Filling(tid, ready, ids, sums))
                if pull.transport != TransportName.SHM:
                    for layer in new:
                        self.sender.send_layer(st.sock, st.ident, pull, layer, segments)
                st.sent, st.last = ready, now
                if ready == lay.num_layers:
                    del self._streams[tid]
                    if pull.transport != TransportName.SHM:
                        st.sock.send_multipart([st.ident, self.codec.encode(wire.End(tid, lay.num_layers))])
                    self.leases.move(tid, LeaseState.AWAIT_ACK)
            elif now - st.last >= self.keepalive_s:
                self.sender.reply(st.sock, st.ident, wire.Filling(tid, st.sent, st.block_ids or []))
                st.last = now
        except LeaseError as exc:
            # The engine thread ended the lease (abort_fill) while this stream was being served: the
            # decode node gets a Reject and recomputes; this thread keeps serving every other lease.
            self._streams.pop(tid, None)
            self.sender.reply(st.sock, st.ident, wire.Reject(tid, f"lease ended: {exc}"))
        except (zmq.ZMQError, OSError) as exc:
            log.warning("layer-wise send of %s failed: %s", tid, exc)
            self._streams.pop(tid, None)
            with contextlib.suppress(LeaseError):
                self.leases.move(tid, LeaseState.FAILED, f"send failed: {exc}")
