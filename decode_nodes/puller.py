"""The decode side's puller: a few threads that each pull one request's blocks from its prefill node
into this engine's cache, then acknowledge (Done) so the prefill node frees them. A failed pull is an
outcome like any other: it is reported back to the engine as a load error on the request's blocks.

Threads block in ``zmq.poll`` with the transfer's deadline: none spins. A socket that saw a failure
is closed and never reused (its state is unknown; a late frame must not land in the next transfer).
Every message is signed and every answer verified with the cluster secret (``wire.Codec``): a prefill
node that refuses our MAC answers at once with a Reject, and the pull fails then, not at its deadline.

A pull's time runs from the job's hand-over by the engine thread to its outcome (every block in
place; the Done that frees the prefill node's blocks follows, off the request's path). What never
changes between pulls is kept: one socket per endpoint per pool thread, and per ipc endpoint the
prefill process the last shm Grant proved (held by a pidfd), so the next shm pull there copies while
its Grant is in flight (``transports.KnownPeer``; forgotten after any failure there, and never taken
for a restarted prefill node: its Grant names another process). A small shm pull is not split
(``shm_split_min_bytes``): this side copies it alone, with no second answer to wait for.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import zmq

from contracts.transfer import TransferReport
from kv_transfer import wire
from kv_transfer.config import TransportName
from kv_transfer.layout import KVLayout
from kv_transfer.stats import TransferStats
from kv_transfer.transports import (
    CmaTransport,
    KnownPeer,
    LayerwiseTransport,
    TransferFailed,
    Transport,
    transport_for,
    verify_answer,
)

if TYPE_CHECKING:
    from kv_transfer.ucx import UcxReceiver

log = logging.getLogger("tandem.kv.puller")


class PullWatch(Protocol):
    """Who waits on a synchronous pull as it goes (``kv_connector.layer_gate``), told from the pull's thread."""

    def layers(self, written: int) -> None:
        """``written`` leading layers are in place."""

    def ended(self, ok: bool) -> None:
        """The pull ended: every layer in place (``ok``), or failed."""


@dataclass
class PullJob:
    request_id: str
    transfer_id: str
    endpoint: str
    transport: str
    segments: list[wire.Segment]
    local_block_ids: list[int]
    deadline: float
    """time.monotonic() by which the pull must be complete."""
    checksum: bool = True
    cancelled: threading.Event = field(default_factory=threading.Event)
    layerwise: bool = False
    """Pull while the prefill computes (``transports.LayerwiseTransport``): ``segments`` address prompt
    positions, and ``deadline`` is a stall timeout, restarted by every sign of progress."""
    watch: PullWatch | None = None
    """A synchronous (split) pull's observer; None for a pull vLLM waits for as a whole."""
    submitted: float = field(default_factory=time.perf_counter)
    """When the engine thread handed the job over: a pull's time counts from here, its wait for a
    pool thread included (that is time the request waits too)."""


@dataclass
class PullOutcome:
    request_id: str
    ok: bool
    local_block_ids: list[int]
    nbytes: int = 0
    seconds: float = 0.0
    reason: str = ""
    transport: str = ""
    started: float = 0.0
    """Wall clock."""

    def report(self) -> TransferReport:
        return TransferReport(
            ok=self.ok,
            bytes=self.nbytes,
            seconds=round(self.seconds, 6),
            transport=self.transport,
            reason=self.reason,
            start=self.started,
            end=self.started + self.seconds,
        )


class Puller:
    def __init__(
        self,
        layout: KVLayout,
        stats: TransferStats,
        codec: wire.Codec,
        *,
        threads: int = 4,
        on_outcome: Callable[[], None] | None = None,
        shm_split: bool = True,
        shm_split_min_bytes: int = 0,
    ) -> None:
        self.layout = layout
        self.codec = codec
        self.shm_split = shm_split
        self.shm_split_min_bytes = shm_split_min_bytes
        """``shm`` pulls smaller than this are copied by this side alone (``ConnectorSettings``)."""
        self._on_outcome = on_outcome
        self.stats = stats
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tandem-kv-pull")
        self._local = threading.local()
        self._jobs: dict[str, PullJob] = {}
        self._lock = threading.Lock()
        self.outcomes: queue.SimpleQueue[PullOutcome] = queue.SimpleQueue()
        self._ucx: UcxReceiver | None = None
        self._ucx_lock = threading.Lock()
        self._peers: dict[str, KnownPeer] = {}
        """Per ipc endpoint, the prefill process its last shm Grant proved (``transports.KnownPeer``):
        the next shm pull there copies before its Grant comes."""
        self.early_copies = 0
        """shm pulls whose copy started before their Grant."""

    def submit(self, job: PullJob) -> None:
        with self._lock:
            self._jobs[job.request_id] = job
        self._pool.submit(self._run, job)

    def cancel(self, request_id: str) -> bool:
        """Abandon a pull (request aborted): it ends as a failed outcome and the lease is released."""
        with self._lock:
            job = self._jobs.get(request_id)
        if job is not None:
            job.cancelled.set()
        return job is not None

    def release(self, endpoint: str, transfer_id: str, reason: str) -> None:
        """Tell a prefill node to free a lease we will not pull (no room here, full local hit, abort)."""
        self._pool.submit(self._send_release, endpoint, transfer_id, reason)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- pool threads ----------------------------------------------------------------------------------
    def _socket(self, endpoint: str) -> zmq.Socket[bytes]:
        socks: dict[str, zmq.Socket[bytes]] = self._local.__dict__.setdefault("socks", {})
        sock = socks.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(endpoint)
            socks[endpoint] = sock
        return sock

    def _discard(self, endpoint: str) -> None:
        sock = self._local.__dict__.get("socks", {}).pop(endpoint, None)
        if sock is not None:
            sock.close(0)

    def _send_release(self, endpoint: str, transfer_id: str, reason: str) -> None:
        try:
            sock = self._socket(endpoint)
            sock.send(self.codec.encode(wire.Release(transfer_id, reason)))
            if not sock.poll(2000):  # the Ack; a dead prefill node has nothing left to free
                self._discard(endpoint)
                return
            answer = verify_answer(self.codec, sock.recv())
            if isinstance(answer, wire.Reject):
                log.warning("release of %s at %s refused: %s", transfer_id, endpoint, answer.reason)
        except (zmq.ZMQError, TransferFailed) as exc:
            log.warning("release of %s at %s failed: %s", transfer_id, endpoint, exc)
            self._discard(endpoint)

    def _run(self, job: PullJob) -> None:
        t0 = job.submitted
        wall0 = time.time() - (time.perf_counter() - t0)
        sock = None
        try:
            if job.cancelled.is_set():
                raise TransferFailed("cancelled before it started")
            sock = self._socket(job.endpoint)
            transport: Transport | UcxReceiver
            if job.transport == TransportName.UCX:
                receiver = transport = self._ucx_receiver()
                pull = wire.Pull(
                    job.transfer_id, job.segments, TransportName.UCX.value, job.checksum, receiver.target(self.layout)
                )
            elif job.layerwise:
                transport = LayerwiseTransport(
                    job.transport,
                    stall_s=max(0.0, job.deadline - time.monotonic()),
                    on_layers=job.watch.layers if job.watch is not None else None,
                    cancelled=job.cancelled.is_set,
                )
                pull = transport.pull(job.transfer_id, job.segments, job.checksum, self.layout)
            else:
                with self._lock:
                    known = self._peers.get(job.endpoint)
                split = self.shm_split and self.layout.nbytes(job.segments) >= self.shm_split_min_bytes
                transport = transport_for(job.transport, shm_split=split, known=known)
                pull = transport.pull(job.transfer_id, job.segments, job.checksum, self.layout)
            sock.send(self.codec.encode(pull))
            nbytes = transport.receive(sock, pull, self.layout, job.deadline, codec=self.codec)
            if isinstance(transport, CmaTransport) and transport.learned is not None:
                with self._lock:
                    self._peers[job.endpoint] = transport.learned
                    self.early_copies += int(transport.early)
            if job.cancelled.is_set():
                raise TransferFailed("cancelled")
            seconds = time.perf_counter() - t0
            self.stats.record_recv(nbytes, sum(s.count for s in job.segments), seconds)
        except TransferFailed as exc:
            self._fail(job, sock, exc.reason, refused=exc.refused, started=wall0)
            return
        except Exception as exc:  # never lose an outcome: the engine waits for it
            log.exception("pull %s crashed", job.transfer_id)
            self._fail(job, sock, f"{type(exc).__name__}: {exc}", refused=False, started=wall0)
            return
        # Every block is in place: the request goes on now. The Done only frees the prefill node's
        # blocks, which this request does not wait for, so it is sent after the outcome, off its path.
        if job.watch is not None:
            job.watch.ended(True)
        self._finish(PullOutcome(job.request_id, True, job.local_block_ids, nbytes, seconds, "", job.transport, wall0))
        self._acknowledge(job.endpoint, sock, job.transfer_id)

    def _acknowledge(self, endpoint: str, sock: zmq.Socket[bytes], transfer_id: str) -> None:
        """The Done of a delivered pull. If it cannot be sent, the pull still stands (its blocks are
        here and verified): the prefill node's lease then ends at its deadline instead."""
        try:
            sock.send(self.codec.encode(wire.Done(transfer_id, True)))
        except zmq.ZMQError as exc:
            log.warning("Done for %s at %s not sent (the lease ends at its deadline): %s", transfer_id, endpoint, exc)
            self._discard(endpoint)

    def _ucx_receiver(self) -> UcxReceiver:
        from kv_transfer.ucx import UcxError, UcxReceiver

        with self._ucx_lock:
            if self._ucx is None:
                try:
                    self._ucx = UcxReceiver()
                except UcxError as exc:
                    raise TransferFailed(f"ucx unavailable: {exc}") from exc
            return self._ucx

    def _fail(
        self, job: PullJob, sock: zmq.Socket[bytes] | None, reason: str, *, refused: bool, started: float
    ) -> None:
        if job.watch is not None:  # first: an engine step may be waiting on it
            job.watch.ended(False)
        log.warning("pull %s for %s failed: %s", job.transfer_id, job.request_id, reason)
        with self.stats.lock:
            self.stats.recv_failed += 1
            self.stats.rejected += int(refused)
        if sock is not None:
            self._discard(job.endpoint)
        with self._lock:  # whatever failed, the next shm pull there waits for its Grant to copy
            self._peers.pop(job.endpoint, None)
        if not refused:  # tell the prefill node, on a fresh socket, so it frees the lease now
            self._send_done(job.endpoint, job.transfer_id, reason)
        self._finish(
            PullOutcome(
                job.request_id,
                False,
                job.local_block_ids,
                reason=reason,
                transport=job.transport,
                started=started,
                seconds=time.time() - started,
            )
        )

    def _send_done(self, endpoint: str, transfer_id: str, reason: str) -> None:
        try:
            sock = self._socket(endpoint)
            sock.send(self.codec.encode(wire.Done(transfer_id, False, reason)), zmq.NOBLOCK)
            # Release too: if the lease never left HELD (we failed before the server saw our Pull),
            # Done is refused by the state machine and Release ends it instead.
            sock.send(self.codec.encode(wire.Release(transfer_id, reason)), zmq.NOBLOCK)
            if sock.poll(1000):
                sock.recv()
            else:
                self._discard(endpoint)
        except zmq.ZMQError:
            self._discard(endpoint)

    def known_peer(self, endpoint: str) -> KnownPeer | None:
        """The prefill process the last shm Grant on ``endpoint`` proved (None: none, or forgotten)."""
        with self._lock:
            return self._peers.get(endpoint)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._jobs)

    def _finish(self, outcome: PullOutcome) -> None:
        with self._lock:
            self._jobs.pop(outcome.request_id, None)
        self.outcomes.put(outcome)
        if self._on_outcome is not None:
            self._on_outcome()
