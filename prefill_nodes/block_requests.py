"""The block server's side of the wire protocol: each message a decode node or a router sends, from its
frames to its answer, and the pulls that wait for their lease.

At the boundary (``handle``), before anything else: every frame's MAC under the cluster secret
(``wire.Codec``); a frame that fails is answered with a signed Reject, logged and counted
(``unauthenticated``), never acted on. A peer of another protocol version gets a Reject that says so. An
``shm`` Pull is served only on the ipc socket, and only when the peer's Unix-socket credentials show this
uid and the pid its ``CmaTarget`` names (``auth.py``): ``process_vm_writev`` then writes into the process
that asked, not one the message names. Faults (``wire.Fault``) are armed only on a server started with
``faults=True``.

Then by kind: a Pull is served (``block_sender`` for a whole pull, ``layer_streams`` for a layer-wise
one), or parked when its lease is not there yet (the Pull can overtake the engine step that hands the
lease over) or, for a whole pull, while the prefill still computes: for at most ``PARK_S``. Done and
Release end the lease (a Release before its lease is remembered for ``PARK_S`` and applied when it
comes); Query is answered from what was served."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import zmq

from contracts.errors import PeerUnauthenticated, UpstreamError, VersionMismatch
from kv_transfer import wire
from kv_transfer.auth import peer_credentials
from kv_transfer.config import TransportName
from kv_transfer.stats import TransferStats
from prefill_nodes.block_sender import BlockSender
from prefill_nodes.layer_streams import LayerStreams
from prefill_nodes.lease import LeaseError, LeaseState, LeaseTable

log = logging.getLogger("tandem.kv.server")

PARK_S = 10.0
"""How long a Pull may wait for its lease to appear (the Pull can overtake the engine step that hands
the lease to this worker)."""

REFUSAL_LOG_S = 10.0
"""At most one log line per this many seconds for unauthenticated frames (each is counted in the
``tandem_kv_unauthenticated_total`` metric regardless)."""


@dataclass
class Parked:
    sock: zmq.Socket[bytes]
    ident: bytes
    pull: wire.Pull
    since: float


class RequestHandler:
    """Answers the block server's messages; used only on its thread."""

    def __init__(
        self,
        sender: BlockSender,
        streams: LayerStreams,
        stats: TransferStats,
        armed: dict[str, float],
        *,
        faults: bool,
    ) -> None:
        self.sender = sender
        self.streams = streams
        self.leases: LeaseTable = sender.leases
        self.codec = sender.codec
        self.stats = stats
        self.faults_enabled = faults
        self._armed = armed
        """The block server's armed faults (kind -> seconds), shared with the sender."""
        self.local: set[zmq.Socket[bytes]] = set()
        """The ipc sockets: their peers carry kernel-checked credentials."""
        self._parked: dict[str, Parked] = {}
        self._held: dict[str, tuple[Parked, float]] = {}
        """Pulls delayed by the ``hold`` fault, with when to serve them."""
        self._early_release: dict[str, float] = {}
        self._refused_logged_at = -REFUSAL_LOG_S
        self._refused_since_log = 0
        self.version_refusals = 0
        """Messages refused for another protocol version (each answered with a Reject)."""

    def next_wakes(self) -> list[float]:
        """Monotonic times at which a parked pull times out or a held one is let go."""
        return [p.since + PARK_S for p in self._parked.values()] + [until for _, until in self._held.values()]

    def handle(self, sock: zmq.Socket[bytes], frames: list[zmq.Frame]) -> None:
        """One message from ``sock``: authenticated and decoded first, then acted on by its kind."""
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
            self.sender.reply(sock, ident, wire.Reject("", f"unauthenticated: {exc.message}"))
            return
        except VersionMismatch as exc:  # a peer of another release: say so at once, act on nothing
            self.version_refusals += 1
            log.error("refused a KV message: %s", exc.message)
            self.sender.reply(sock, ident, wire.Reject("", f"{wire.VERSION_REJECT}: {exc.message}"))
            return
        except UpstreamError as exc:  # authenticated, yet no message of this version: say so, keep serving
            log.warning("%s", exc.message)
            self.sender.reply(sock, ident, wire.Reject("", exc.message))
            return
        if isinstance(msg, wire.Pull):
            refusal = self._refuse_peer(sock, frames[1], msg)
            if refusal:
                with self.stats.lock:
                    self.stats.peer_refused += 1
                log.warning("refused %s pull %s: %s", msg.transport, msg.transfer_id, refusal)
                self.sender.reply(sock, ident, wire.Reject(msg.transfer_id, refusal))
                return
            ended = self.leases.ended_state(msg.transfer_id)
            if "hold" in self._armed and ended is None:
                self._held[msg.transfer_id] = (
                    Parked(sock, ident, msg, time.monotonic()),
                    time.monotonic() + self._armed.pop("hold"),
                )
                log.warning("fault injection: holding pull %s", msg.transfer_id)
                return
            live = self.leases.get(msg.transfer_id)
            if ended is not None:
                self.sender.reply(sock, ident, wire.Reject(msg.transfer_id, f"lease already {ended}"))
            elif live is None or (live.state is LeaseState.FILLING and not msg.layerwise):
                self._parked[msg.transfer_id] = Parked(sock, ident, msg, time.monotonic())
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
                    self.sender.reply(
                        parked.sock, parked.ident, wire.Reject(msg.transfer_id, f"released: {msg.reason}")
                    )
                self._early_release[msg.transfer_id] = time.monotonic()
            else:
                self._release(msg.transfer_id, msg.reason)
            self.sender.reply(sock, ident, wire.Ack())
        elif isinstance(msg, wire.Query):
            self.sender.reply(sock, ident, self.sender.report(msg.transfer_id))
        elif isinstance(msg, wire.Fault):
            if self.faults_enabled:
                self._armed[msg.kind] = msg.seconds
                log.warning("fault injection: armed %s (%.1f s)", msg.kind, msg.seconds)
            else:
                log.warning("refused a %s fault: fault injection is off on this node", msg.kind)
            self.sender.reply(sock, ident, wire.Ack(ok=self.faults_enabled))

    def _refuse_peer(self, sock: zmq.Socket[bytes], frame: zmq.Frame, pull: wire.Pull) -> str:
        """Why this peer may not have this pull ("" when it may). A ``shm`` pull hands the peer this
        process's pid and cache addresses and may make this process write into the pid it names:
        only for a process of this host and user that is the very one it names, proven by the
        kernel's credentials of its Unix socket, never over tcp."""
        if pull.transport != TransportName.SHM:
            return ""
        if sock not in self.local:
            return "shm is a one-host transport: refused over tcp (use the ipc endpoint)"
        peer = peer_credentials(frame)
        if peer is None:
            return "shm needs the peer's Unix-socket credentials, which this socket does not have"
        if peer.uid != os.getuid():
            return f"shm peer runs as uid {peer.uid}, not this node's uid {os.getuid()}"
        if pull.cma is not None and pull.cma.pid != peer.pid:
            return f"shm pull names pid {pull.cma.pid}, but its socket belongs to pid {peer.pid}"
        return ""

    def housekeeping(self) -> None:
        """What is due whenever the server wakes: expired leases ended, early releases applied, held
        pulls let go, parked pulls served or refused once their lease is there or PARK_S has passed,
        and every layer-wise stream advanced."""
        for lease in self.leases.expire():
            log.warning("lease %s expired (%s)", lease.transfer_id, lease.reason)
            self.sender.forget(lease.transfer_id)
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
                    self.sender.reply(parked.sock, parked.ident, wire.Reject(tid, "the prefill is still computing"))
                continue  # a whole pull waits for the prefill to end (or for PARK_S)
            if live is not None:
                del self._parked[tid]
                self._serve(parked.sock, parked.ident, parked.pull)
            elif ended is not None:
                del self._parked[tid]
                self.sender.reply(parked.sock, parked.ident, wire.Reject(tid, f"lease already {ended}"))
            elif now - parked.since > PARK_S:
                del self._parked[tid]
                self.sender.reply(parked.sock, parked.ident, wire.Reject(tid, "unknown or ended lease"))
        self.streams.advance_all()

    def _serve(self, sock: zmq.Socket[bytes], ident: bytes, pull: wire.Pull) -> None:
        if pull.layerwise:
            self.streams.open(sock, ident, pull)
        else:
            self.sender.serve(sock, ident, pull)

    def _release(self, tid: str, reason: str) -> None:
        try:
            self.leases.move(tid, LeaseState.RELEASED, reason)
        except LeaseError as exc:
            log.info("release of %s ignored: %s", tid, exc)
        self.sender.forget(tid)

    def _finish(self, msg: wire.Done) -> None:
        self.sender.forget(msg.transfer_id)
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
