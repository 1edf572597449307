"""The prefill side's block server: one thread, one ROUTER socket per endpoint (tcp, ipc), serving the
blocks of leased requests to decode nodes that pull them, and moving each lease through its states
(``lease.py``). It sleeps in ``zmq.poll`` until a message comes or the next lease deadline passes:
nothing spins while the node is idle.

At the boundary (``_handle``), before anything else: every frame's MAC under the cluster secret
(``wire.Codec``); a frame that fails is answered with a signed Reject, logged and counted
(``unauthenticated``), never acted on. An ``shm`` Pull is served only on the ipc socket, and only when
the peer's Unix-socket credentials show this uid and the pid its ``CmaTarget`` names (``auth.py``):
``process_vm_writev`` then writes into the process that asked, not one the message names. Faults
(``wire.Fault``) are armed only on a server started with ``faults=True``, which says so at start.

Layer-wise pulls (``Pull.layerwise``) are served while the prefill computes: the engine thread opens
the lease before the prefill (``open_fill``) and reports each layer as it is written (``fill``, from
``save_kv_layer``); this thread keeps one stream per such pull and, whenever it wakes, sends what the
prefill has written since (``Filling`` and, for tcp/ipc, the layers' frames), a heartbeat every
``keepalive_s`` while nothing new is there, and a Reject if the prefill failed or was aborted
(``abort_fill``), which ends the lease at once."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import zmq

from contracts.errors import PeerUnauthenticated, UpstreamError, VersionMismatch
from kv_transfer import wire
from kv_transfer.auth import peer_credentials
from kv_transfer.layout import KVLayout, checksum
from kv_transfer.stats import TransferStats
from kv_transfer.transports import TransferFailed, cma_pairs, process_vm_writev

if TYPE_CHECKING:
    from kv_transfer.ucx import UcxSender
from prefill_nodes.lease import LeaseError, LeaseState, LeaseTable

log = logging.getLogger("tandem.kv.server")

PARK_S = 10.0
"""How long a Pull may wait for its lease to appear (the Pull can overtake the engine step that hands
the lease to this worker)."""


REFUSAL_LOG_S = 10.0
"""At most one log line per this many seconds for unauthenticated frames (each is counted in the
``tandem_kv_unauthenticated_total`` metric regardless)."""

SERVED_KEPT = 10_000
"""Recent pulls remembered for ``Query`` (a router asks right after a streamed answer ends)."""


KEEPALIVE_S = 1.0
"""How often a layer-wise stream tells its decode node the prefill is still computing (its stall
timeout, ``transfer_timeout_s``, must be longer)."""


@dataclass
class _Parked:
    sock: zmq.Socket[bytes]
    ident: bytes
    pull: wire.Pull
    since: float


@dataclass
class _Stream:
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
        self._streams: dict[str, _Stream] = {}
        self.leases = leases
        self.endpoints = endpoints
        self.stats = stats
        self.codec = codec
        self.faults_enabled = faults
        self._armed: dict[str, float] = {}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._wake_addr = f"inproc://tandem-kv-wake-{id(self)}"
        self._wake_lock = threading.Lock()
        self._wake_push: zmq.Socket[bytes] | None = None
        self._parked: dict[str, _Parked] = {}
        self._refused_logged_at = -REFUSAL_LOG_S
        self._refused_since_log = 0
        self.version_refusals = 0
        """Messages refused for another protocol version (each answered with a Reject)."""
        self._local: set[zmq.Socket[bytes]] = set()
        """The ipc sockets: their peers carry kernel-checked credentials."""
        self._held: dict[str, tuple[_Parked, float]] = {}
        """Pulls delayed by the ``hold`` fault, with when to serve them."""
        self._early_release: dict[str, float] = {}
        self._served: dict[str, tuple[str, int, int, float]] = {}
        """transfer id → (transport, bytes, blocks, wall-clock start) of recent pulls, for Query."""
        self._ucx: UcxSender | None = None
        """UcxSender, started at the first ``ucx`` pull (importing ucxx costs seconds; most nodes never
        need it)."""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tandem-kv-server", daemon=True)

    # -- engine thread side ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.faults_enabled:
            log.warning(
                "FAULT INJECTION IS ON for the KV block server on %s (TANDEM_KV_FAULTS=1): any holder "
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
                    self._local.add(sock)
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
                            self._handle(sock, sock.recv_multipart(copy=False))
                self._housekeeping()
        finally:
            for sock in socks:
                sock.close(0)
            wake.close(0)
            if self._ucx is not None:
                self._ucx.close()

    def _timeout_ms(self) -> int:
        nexts = [p.since + PARK_S for p in self._parked.values()] + [until for _, until in self._held.values()]
        nexts += [st.last + self.keepalive_s for st in self._streams.values()]
        deadline = self.leases.next_deadline()
        if deadline is not None:
            nexts.append(deadline - time.time() + time.monotonic())
        if not nexts:
            return 5000
        return max(1, min(5000, int((min(nexts) - time.monotonic()) * 1000) + 1))

    def _housekeeping(self) -> None:
        for lease in self.leases.expire():
            log.warning("lease %s expired (%s)", lease.transfer_id, lease.reason)
            self._forget(lease.transfer_id)
        now = time.monotonic()
        for tid in list(self._early_release):
            if self.leases.get(tid) is not None:
                self._release(tid, "released before its lease arrived")
                del self._early_release[tid]
            elif now - self._early_release[tid] > PARK_S:
                del self._early_release[tid]
        for tid, (parked, until) in list(self._held.items()):
            if now >= until:
                del self._held[tid]
                self._parked[tid] = parked
        for tid, parked in list(self._parked.items()):
            ended = self.leases.ended_state(tid)
            live = self.leases.get(tid)
            if live is not None and live.state is LeaseState.FILLING and not parked.pull.layerwise:
                if now - parked.since > PARK_S:
                    del self._parked[tid]
                    self._reply(parked.sock, parked.ident, wire.Reject(tid, "the prefill is still computing"))
                continue  # a whole pull waits for the prefill to end (or for PARK_S)
            if live is not None:
                del self._parked[tid]
                self._serve(parked.sock, parked.ident, parked.pull)
            elif ended is not None:
                del self._parked[tid]
                self._reply(parked.sock, parked.ident, wire.Reject(tid, f"lease already {ended}"))
            elif now - parked.since > PARK_S:
                del self._parked[tid]
                self._reply(parked.sock, parked.ident, wire.Reject(tid, "unknown or ended lease"))
        for tid in list(self._streams):
            self._advance(tid)

    def _handle(self, sock: zmq.Socket[bytes], frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        if len(frames) < 2:
            return  # an empty message: nothing to answer
        try:
            msg = self.codec.decode(frames[1].buffer)
        except PeerUnauthenticated as exc:
            # Answer at once (a misconfigured node fails fast instead of at its deadline), act on nothing.
            with self.stats.lock:
                self.stats.unauthenticated += 1
            self._refused_since_log += 1
            now = time.monotonic()
            if now - self._refused_logged_at >= REFUSAL_LOG_S:  # a flood must not flood the log too
                log.warning(
                    "refused %d unauthenticated KV message(s), the last: %s", self._refused_since_log, exc.message
                )
                self._refused_logged_at, self._refused_since_log = now, 0
            self._reply(sock, ident, wire.Reject("", f"unauthenticated: {exc.message}"))
            return
        except VersionMismatch as exc:  # a peer of another release: say so at once, act on nothing
            self.version_refusals += 1
            log.error("refused a KV message: %s", exc.message)
            self._reply(sock, ident, wire.Reject("", f"{wire.VERSION_REJECT}: {exc.message}"))
            return
        except UpstreamError as exc:  # authenticated, yet no message of this version: say so, keep serving
            log.warning("%s", exc.message)
            self._reply(sock, ident, wire.Reject("", exc.message))
            return
        if isinstance(msg, wire.Pull):
            refusal = self._refuse_peer(sock, frames[1], msg)
            if refusal:
                with self.stats.lock:
                    self.stats.peer_refused += 1
                log.warning("refused %s pull %s: %s", msg.transport, msg.transfer_id, refusal)
                self._reply(sock, ident, wire.Reject(msg.transfer_id, refusal))
                return
            ended = self.leases.ended_state(msg.transfer_id)
            if "hold" in self._armed and ended is None:
                self._held[msg.transfer_id] = (
                    _Parked(sock, ident, msg, time.monotonic()),
                    time.monotonic() + self._armed.pop("hold"),
                )
                log.warning("fault injection: holding pull %s", msg.transfer_id)
                return
            live = self.leases.get(msg.transfer_id)
            if ended is not None:
                self._reply(sock, ident, wire.Reject(msg.transfer_id, f"lease already {ended}"))
            elif live is None or (live.state is LeaseState.FILLING and not msg.layerwise):
                self._parked[msg.transfer_id] = _Parked(sock, ident, msg, time.monotonic())
            else:
                self._serve(sock, ident, msg)
        elif isinstance(msg, wire.Done):
            self._finish(msg)
        elif isinstance(msg, wire.Release):
            if self.leases.get(msg.transfer_id) is None:
                # Before its lease: a router gave up on a layer-wise pair whose prefill never opened one
                # (refused, or its node unreachable). A pull already waiting for it is answered now, so
                # its decode node frees its blocks at once rather than at PARK_S.
                parked = self._parked.pop(msg.transfer_id, None)
                if parked is not None:
                    self._reply(parked.sock, parked.ident, wire.Reject(msg.transfer_id, f"released: {msg.reason}"))
                self._early_release[msg.transfer_id] = time.monotonic()
            else:
                self._release(msg.transfer_id, msg.reason)
            self._reply(sock, ident, wire.Ack())
        elif isinstance(msg, wire.Query):
            self._reply(sock, ident, self._report(msg.transfer_id))
        elif isinstance(msg, wire.Fault):
            if self.faults_enabled:
                self._armed[msg.kind] = msg.seconds
                log.warning("fault injection: armed %s (%.1f s)", msg.kind, msg.seconds)
            else:
                log.warning("refused a %s fault: fault injection is off on this node", msg.kind)
            self._reply(sock, ident, wire.Ack(ok=self.faults_enabled))

    def _refuse_peer(self, sock: zmq.Socket[bytes], frame: zmq.Frame, pull: wire.Pull) -> str:
        """Why this peer may not have this pull ("" when it may). A ``shm`` pull hands the peer this
        process's pid and cache addresses and may make this process write into the pid it names:
        only for a process of this host and user that is the very one it names, proven by the
        kernel's credentials of its Unix socket, never over tcp."""
        if pull.transport != "shm":
            return ""
        if sock not in self._local:
            return "shm is a one-host transport: refused over tcp (use the ipc endpoint)"
        peer = peer_credentials(frame)
        if peer is None:
            return "shm needs the peer's Unix-socket credentials, which this socket does not have"
        if peer.uid != os.getuid():
            return f"shm peer runs as uid {peer.uid}, not this node's uid {os.getuid()}"
        if pull.cma is not None and pull.cma.pid != peer.pid:
            return f"shm pull names pid {pull.cma.pid}, but its socket belongs to pid {peer.pid}"
        return ""

    def _report(self, tid: str) -> wire.Message:
        transport, nbytes, blocks, start = self._served.get(tid, ("", 0, 0, 0.0))
        lease = self.leases.get(tid)
        if lease is not None:
            return wire.LeaseReport(tid, lease.state.value, transport, nbytes, blocks, start, 0.0, lease.reason)
        ended = self.leases.ended_info(tid)
        if ended is None:
            return wire.Reject(tid, "unknown lease")
        state, end, reason = ended
        return wire.LeaseReport(tid, state.value, transport, nbytes, blocks, start, end or 0.0, reason)

    def _reply(self, sock: zmq.Socket[bytes], ident: bytes, msg: wire.Message) -> None:
        sock.send_multipart([ident, self.codec.encode(msg)])

    def _release(self, tid: str, reason: str) -> None:
        try:
            self.leases.move(tid, LeaseState.RELEASED, reason)
        except LeaseError as exc:
            log.info("release of %s ignored: %s", tid, exc)
        self._forget(tid)

    def _finish(self, msg: wire.Done) -> None:
        self._forget(msg.transfer_id)
        try:
            lease = self.leases.move(msg.transfer_id, LeaseState.DONE if msg.ok else LeaseState.FAILED, msg.reason)
        except LeaseError as exc:
            log.info("Done for %s ignored: %s", msg.transfer_id, exc)
            return
        if not msg.ok:
            log.warning("decode node failed transfer %s: %s", msg.transfer_id, msg.reason)
            self.stats.failed_transfers += 1
        else:
            self.stats.record_send(lease.block_ids, time.time() - lease.created)

    def _serve(self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull) -> None:
        if pull.layerwise:
            self._open_stream(sock, ident, pull)
            return
        tid = pull.transfer_id
        lease = self.leases.get(tid)
        if lease is None or lease.state is not LeaseState.HELD:
            self._reply(sock, ident, wire.Reject(tid, f"lease is {lease.state if lease else 'gone'}"))
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
                self._reply(sock, ident, wire.Reject(tid, f"segment {s} is outside the lease"))
                return
        if not self._begin_sending(sock, ident, pull):
            return
        try:
            if pull.transport == "shm":
                self._grant(sock, ident, pull)
            elif pull.transport == "ucx":
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

    def _send_frames(self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull) -> None:
        lay = self.layout
        for layer in range(lay.num_layers):
            self._send_layer(sock, ident, pull, layer, pull.segments)
        sock.send_multipart([ident, self.codec.encode(wire.End(pull.transfer_id, lay.num_layers))])

    # -- layer-wise streams ----------------------------------------------------------------------------
    def _begin_sending(self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull) -> bool:
        """Move the lease to SENDING and note what is served (for the router's later Query); False, with
        a Reject sent, when the engine thread ended the lease (abort_fill) since the caller's check."""
        tid = pull.transfer_id
        try:
            self.leases.move(tid, LeaseState.SENDING)
        except LeaseError as exc:
            self._reply(sock, ident, wire.Reject(tid, f"lease ended: {exc}"))
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

    def _open_stream(self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull) -> None:
        tid = pull.transfer_id
        lease = self.leases.get(tid)
        if lease is None or lease.state not in (LeaseState.FILLING, LeaseState.HELD):
            self._reply(sock, ident, wire.Reject(tid, f"lease is {lease.state if lease else 'gone'}"))
            return
        if pull.transport not in ("tcp", "ipc", "shm") or any(s.count <= 0 or s.remote < 0 for s in pull.segments):
            self._reply(sock, ident, wire.Reject(tid, f"not a layer-wise pull this server serves ({pull.transport})"))
            return
        if not self._begin_sending(sock, ident, pull):
            return
        lay = self.layout
        if pull.transport == "shm":  # the decode node copies every layer itself: this core computes
            here = list(lay.addresses)
            self._reply(sock, ident, wire.Grant(tid, os.getpid(), here, [lay.block_nbytes] * lay.num_layers, []))
        self._streams[tid] = _Stream(sock, ident, pull, time.monotonic())
        self._advance(tid)

    def _advance(self, tid: str) -> None:
        """Send a stream what its prefill has written since it last looked, a heartbeat when nothing,
        or a Reject when the lease ended under it (the prefill failed, or the decode node said Done)."""
        st = self._streams[tid]
        lease = self.leases.get(tid)
        if lease is None:
            del self._streams[tid]
            info = self.leases.ended_info(tid)
            state, reason = (info[0].value, info[2]) if info else ("gone", "")
            self._reply(st.sock, st.ident, wire.Reject(tid, f"lease {state}: {reason}"))
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
                        self._reply(st.sock, st.ident, wire.Reject(tid, "positions outside the lease"))
                        return
                    st.block_ids = [lease.block_ids[p] for p in positions]
                    st.segments = wire.resolve(pull.segments, st.block_ids)
                ids, segments = st.block_ids or [], st.segments or []  # both set together, just above
                new = range(st.sent, ready)
                sums = (
                    [[checksum(lay.span(layer, s.remote, s.count)) for s in segments] for layer in new]
                    if pull.checksum and pull.transport == "shm"
                    else []
                )
                self._reply(st.sock, st.ident, wire.Filling(tid, ready, ids, sums))
                if pull.transport != "shm":
                    for layer in new:
                        self._send_layer(st.sock, st.ident, pull, layer, segments)
                st.sent, st.last = ready, now
                if ready == lay.num_layers:
                    del self._streams[tid]
                    if pull.transport != "shm":
                        st.sock.send_multipart([st.ident, self.codec.encode(wire.End(tid, lay.num_layers))])
                    self.leases.move(tid, LeaseState.AWAIT_ACK)
            elif now - st.last >= self.keepalive_s:
                self._reply(st.sock, st.ident, wire.Filling(tid, st.sent, st.block_ids or []))
                st.last = now
        except LeaseError as exc:
            # The engine thread ended the lease (abort_fill) while this stream was being served: the
            # decode node gets a Reject and recomputes; this thread keeps serving every other lease.
            self._streams.pop(tid, None)
            self._reply(st.sock, st.ident, wire.Reject(tid, f"lease ended: {exc}"))
        except (zmq.ZMQError, OSError) as exc:
            log.warning("layer-wise send of %s failed: %s", tid, exc)
            self._streams.pop(tid, None)
            with contextlib.suppress(LeaseError):
                self.leases.move(tid, LeaseState.FAILED, f"send failed: {exc}")

    def _send_layer(
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
            self._reply(sock, ident, wire.Reject(pull.transfer_id, f"ucx: {exc}"))
            return False
        self._reply(sock, ident, posted)
        return True

    def _forget(self, tid: str) -> None:
        if self._ucx is not None:
            self._ucx.forget(tid)

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
        self._reply(
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
            self._reply(sock, ident, wire.Pushed(pull.transfer_id, False, exc.reason))
            return
        self._reply(sock, ident, wire.Pushed(pull.transfer_id, True))
