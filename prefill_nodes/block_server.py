"""The prefill side's block server: one thread, one ROUTER socket per endpoint (tcp, ipc), serving the
blocks of leased requests to decode nodes that pull them, and moving each lease through its states
(``lease.py``). It sleeps in ``zmq.poll`` until a message comes or the next deadline passes (a lease's,
a parked pull's, a layer-wise stream's heartbeat): nothing spins while the node is idle.

This module is the server's two sides: the engine thread's calls (``offer`` a lease; for a layer-wise
lease ``open_fill``, ``fill`` per layer written, ``abort_fill``), which only change the lease table and
wake the server, and the server thread's loop. What the loop does with each message and each wake-up
is in its own modules, all used only on that thread:

- ``block_requests``: the wire protocol at the boundary (authentication, versions, peer checks), each
  message's answer, pulls parked until their lease comes, the faults a test arms;
- ``block_sender``: a whole pull's blocks sent by its transport (tcp/ipc frames, shm grant and push,
  UCX), and what was served, for ``Query``;
- ``layer_streams``: layer-wise pulls served while the prefill computes.

Faults (``wire.Fault``) are armed only on a server started with ``faults=True``, which says so at start."""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

from kv_transfer import wire
from kv_transfer.layout import KVLayout
from kv_transfer.stats import TransferStats
from prefill_nodes.block_requests import PARK_S, RequestHandler
from prefill_nodes.block_sender import BlockSender
from prefill_nodes.layer_streams import KEEPALIVE_S, LayerStreams
from prefill_nodes.lease import LeaseError, LeaseState, LeaseTable

__all__ = ["KEEPALIVE_S", "PARK_S", "BlockServer"]

log = logging.getLogger("tandem.kv.server")


class BlockServer:
    def __init__(
        self,
        layout: KVLayout,
        leases: LeaseTable,
        endpoints: list[str],
        stats: TransferStats,
        codec: wire.Codec,
        *,
        faults: bool = False,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.layout = layout
        self.keepalive_s = keepalive_s
        self.leases = leases
        self.endpoints = endpoints
        self.stats = stats
        self.codec = codec
        self.faults_enabled = faults
        self._armed: dict[str, float] = {}
        """Armed faults (kind -> seconds), shared by every part of the server; each fires once."""
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._wake_addr = f"inproc://tandem-kv-wake-{id(self)}"
        self._wake_lock = threading.Lock()
        self._wake_push: zmq.Socket[bytes] | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._sender = BlockSender(layout, leases, codec, self._armed, self._stop)
        self._streams = LayerStreams(self._sender, keepalive_s)
        self._requests = RequestHandler(self._sender, self._streams, stats, self._armed, faults=faults)
        self._thread = threading.Thread(target=self._run, name="tandem-kv-server", daemon=True)

    @property
    def version_refusals(self) -> int:
        """Messages refused for another protocol version (each answered with a Reject)."""
        return self._requests.version_refusals

    # -- engine thread side ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.faults_enabled:
            log.warning(
                "FAULT INJECTION IS ON for the KV block server on %s (TANDEM_NODE_KV_FAULTS=1): any holder "
                "of the cluster secret can corrupt, stall, hold or expire this node's transfers. "
                "Tests only, never in production.",
                self.endpoints,
            )
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def offer(self, transfer_id: str, block_ids: list[int], deadline: float) -> None:
        """A new lease (from the scheduler's metadata): add it and wake the server."""
        if self._armed.pop("expire", None) is not None:
            deadline = time.time() - 1
        self.leases.add(transfer_id, block_ids, deadline)
        self._wake()

    def open_fill(self, transfer_id: str, lease_s: float) -> None:
        """A layer-wise lease, opened as its prefill starts (nothing written yet, no deadline)."""
        self.leases.open_fill(transfer_id, lease_s)
        self._wake()

    def fill(self, transfer_id: str, layers: int, block_ids: list[int] | None = None, *, done: bool = False) -> None:
        """The prefill has written ``layers`` layers of its last chunk into ``block_ids`` (``done``: it
        has ended). Called on the engine thread after each layer: it only wakes this server."""
        try:
            self.leases.fill(transfer_id, layers, block_ids, done=done)
        except LeaseError as exc:  # the decode node failed or released it meanwhile: nothing to serve
            log.debug("fill of %s ignored: %s", transfer_id, exc)
            return
        self._wake()

    def abort_fill(self, transfer_id: str, reason: str) -> None:
        """The prefill failed or was aborted before its KV was whole: end the lease now (a decode
        node pulling it gets a Reject and recomputes or fails the request)."""
        lease = self.leases.get(transfer_id)
        if lease is None:
            return
        to = LeaseState.RELEASED if lease.state in (LeaseState.FILLING, LeaseState.HELD) else LeaseState.FAILED
        try:
            self.leases.move(transfer_id, to, f"prefill ended before its KV was whole: {reason}")
        except LeaseError as exc:
            log.info("abort of %s ignored: %s", transfer_id, exc)
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_push is None:
                self._wake_push = self._ctx.socket(zmq.PUSH)
                self._wake_push.connect(self._wake_addr)
            try:
                self._wake_push.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a thousand wake-ups already queued: the server is awake anyway

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._wake()
            self._thread.join(5)

    # -- server thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        # One socket per endpoint: which socket a frame came in on says whether it came over a Unix
        # socket (with kernel-checked peer credentials) or over tcp (with none).
        socks: list[zmq.Socket[bytes]] = []
        try:
            for ep in self.endpoints:
                sock = self._ctx.socket(zmq.ROUTER)
                socks.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
                if ep.startswith("ipc://"):
                    path = ep[len("ipc://") :]
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    if os.path.exists(path):
                        os.unlink(path)
                    self._requests.local.add(sock)
                sock.bind(ep)
            wake = self._ctx.socket(zmq.PULL)
            wake.bind(self._wake_addr)
        except BaseException as exc:  # bind failure: report to start()
            for sock in socks:
                sock.close(0)
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._timeout_ms()))
                if wake in events:
                    while wake.poll(0):
                        wake.recv()
                for sock in socks:
                    if sock in events:
                        while sock.poll(0):
                            self._requests.handle(sock, sock.recv_multipart(copy=False))
                self._requests.housekeeping()
        finally:
            for sock in socks:
                sock.close(0)
            wake.close(0)
            self._sender.close()

    def _timeout_ms(self) -> int:
        nexts = self._requests.next_wakes() + self._streams.next_wakes()
        deadline = self.leases.next_deadline()
        if deadline is not None:
            nexts.append(deadline - time.time() + time.monotonic())
        if not nexts:
            return 5000
        return max(1, min(5000, int((min(nexts) - time.monotonic()) * 1000) + 1))
