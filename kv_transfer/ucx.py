"""The ``ucx`` data transport: block bytes go over UCX (through ucxx, the ``ucxx-cu12`` wheel; host
memory, no GPU needed) as tagged messages sent from the prefill node's cache straight into the decode
node's cache. Control stays on the pull's ZeroMQ socket:

    decode (UcxReceiver: one UCX worker per puller thread)           prefill (UcxSender: one UCX worker)
      Pull(..., ucx=UcxTarget(worker address, tag, block_nbytes))  ───▶  endpoint to that worker (cached)
                                                                   ◀───  one UCX tag send per (layer, segment)
                                                                   ◀───  UcxPosted(dtype, shape, checksums)
      Done(ok | reason)                                            ───▶  UcxSender.forget(transfer_id)

Tags: segment ``i`` of layer ``l`` travels under ``tag << 32 | l * len(segments) + i``, ``tag`` being a
32-bit number the receiving thread never reuses on the same worker; bytes of an earlier, abandoned pull
carry another tag and can never land in this pull's blocks. A receiving thread that saw a failure drops
its worker (and with it every receive still posted into the cache) and starts a new one, with a new
address, for its next pull: the rule the puller already applies to its sockets.

Nothing spins. The prefill worker runs ucxx's progress thread in blocking mode: it sleeps in epoll until
UCX has work; the server thread's sends reach it through ucxx's delayed submission (queued, then the
worker is signalled). Each decode thread drives its own worker and sleeps in one ``zmq.poll`` on the
pull's socket and the worker's epoll descriptor until the pull's deadline.

Errors: the decode side raises ``TransferFailed`` (transports.py) for everything; the prefill side raises
``UcxSendFailed``; ucxx missing or unusable is ``UcxUnavailable``. Both derive from ``UcxError``.

Measured on a 2-core VM without GPU, 100 MB between two processes on one host (best of 3): tcp
0.24-0.37 GB/s; cma (``error_handling=False``, UCX_TLS=sm or posix,cma) 2.3 GB/s; the idle prefill
worker 0.00 s CPU per 5 s, a decode thread waiting 5 s for a dead peer 0.004 s. ``error_handling``
(UCX peer-failure mode, default on) fails sends to a dead peer at once instead of leaving them hanging,
but UCX then uses only transports that can detect a dead peer: tcp, even on one host.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

from kv_transfer import wire
from kv_transfer.config import TransportName
from kv_transfer.layout import KVLayout, checksum
from kv_transfer.transports import TransferFailed, verify_answer
from kv_transfer.wire import UcxPosted, UcxTarget

log = logging.getLogger("tandem.kv.ucx")

__all__ = [
    "UcxError",
    "UcxOptions",
    "UcxPosted",
    "UcxReceiver",
    "UcxSendFailed",
    "UcxSender",
    "UcxTarget",
    "UcxUnavailable",
]

_TAG_BITS = 32
_MAX_ENDPOINTS = 256
"""Endpoints to decode workers the prefill side keeps (least recently used dropped first)."""
_DRAIN_S = 5.0
"""How long sends may still be in flight after their transfer was forgotten before their endpoint is
closed (a Done can overtake the sender's own completion of the last send)."""


# -- errors and options ------------------------------------------------------------------------------


class UcxError(Exception):
    """Base of this module's errors (besides ``TransferFailed`` on the decode side)."""


class UcxUnavailable(UcxError):
    """ucxx is not installed or cannot start UCX here."""


class UcxSendFailed(UcxError):
    """The prefill node could not post a pull's sends: the pull should be refused."""


@dataclass(frozen=True)
class UcxOptions:
    error_handling: bool = True
    """UCX peer-failure mode on the prefill node's endpoints: sends to a dead decode worker fail instead
    of hanging. UCX then picks only transports that detect a dead peer (tcp), never shm/cma."""
    config: dict[str, str] = field(default_factory=dict)
    """UCX settings for this process's UCX context, without the ``UCX_`` prefix (``{"TLS": "tcp"}``);
    ``UCX_*`` environment variables apply too."""


def _ucxx() -> Any:  # noqa: ANN401 - the ucxx module
    """ucxx's core API, imported on first use: importing ucxx takes ~2 s and sets UCX_* variables in
    this process's environment (RNDV_THRESH, MEMTYPE_CACHE, RNDV_FRAG_MEM_TYPE) when they are unset."""
    try:
        import ucxx._lib.libucxx as ucx_api
    except ImportError as exc:
        raise UcxUnavailable(f"ucxx is not importable ({exc}); pip install ucxx-cu12") from exc
    return ucx_api


def _array(view: Any) -> Any:  # noqa: ANN401 - a ucxx Array over a host buffer
    from ucxx._lib.arr import Array

    return Array(view)


def _context(options: UcxOptions) -> Any:  # noqa: ANN401
    u = _ucxx()
    try:
        return u.UCXContext(config_dict=dict(options.config), feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
    except u.UCXError as exc:
        raise UcxUnavailable(f"UCX did not start: {exc}") from exc


def _tag(u: Any, pull_tag: int, index: int) -> Any:  # noqa: ANN401
    return u.UCXXTag(pull_tag << _TAG_BITS | index)


# -- prefill side ------------------------------------------------------------------------------------


@dataclass
class _Sends:
    peer: bytes
    requests: list[Any]
    keep: list[Any]
    """The ucxx arrays the requests read from (a request holds a bare pointer)."""

    def done(self) -> bool:
        return all(r.completed for r in self.requests)


class UcxSender:
    """The prefill node's UCX worker. ``send`` and ``forget`` are called from one thread (the block
    server's); UCX's own work runs on ucxx's progress thread, which sleeps while nothing moves."""

    def __init__(self, layout: KVLayout, options: UcxOptions | None = None) -> None:
        self.layout = layout
        self.options = options or UcxOptions()
        self._u = _ucxx()
        self._ctx = _context(self.options)
        try:
            self._worker = self._u.UCXWorker(self._ctx, enable_delayed_submission=True)
            self._worker.start_progress_thread(polling_mode=False)
        except self._u.UCXError as exc:
            raise UcxUnavailable(f"UCX worker did not start: {exc}") from exc
        self._endpoints: OrderedDict[bytes, Any] = OrderedDict()
        self._inflight: dict[str, _Sends] = {}
        self._draining: dict[str, tuple[_Sends, float]] = {}
        """Forgotten transfers whose sends had not all completed, with when to stop waiting for them."""
        self._closed = False

    @property
    def address(self) -> bytes:
        """This worker's UCX address (not needed by decode nodes: they never send over UCX)."""
        return bytes(self._worker.address.tobytes())

    def send(self, pull: wire.Pull, target: UcxTarget, *, corrupt: bool = False) -> UcxPosted:
        """Post every segment of ``pull`` (already checked against its lease) to ``target`` and return
        the answer for the ZeroMQ socket. The blocks must stay leased until ``forget``. ``corrupt``
        flips a byte of a copy of the first segment (the ``corrupt`` fault)."""
        lay = self.layout
        if target.block_nbytes != lay.block_nbytes:
            raise UcxSendFailed(
                f"layout mismatch: decode blocks of {target.block_nbytes} bytes, prefill blocks of {lay.block_nbytes}"
            )
        if not 0 <= target.tag < 1 << _TAG_BITS or lay.num_layers * len(pull.segments) >= 1 << _TAG_BITS:
            raise UcxSendFailed(f"tag {target.tag} or segment count out of range")
        if pull.transfer_id in self._inflight:
            raise UcxSendFailed(f"transfer {pull.transfer_id} is already being sent")
        self._prune()
        spans = [[lay.span(layer, s.remote, s.count) for s in pull.segments] for layer in range(lay.num_layers)]
        sums = [[checksum(v) for v in layer] for layer in spans] if pull.checksum else []
        if corrupt and spans and spans[0]:
            bad = spans[0][0].copy()
            bad[len(bad) // 2] ^= 0xFF
            spans[0][0] = bad
        sends = _Sends(target.address, [], [])
        self._inflight[pull.transfer_id] = sends  # before the first send: forget() must see them all
        u = self._u
        try:
            ep = self._endpoint(target.address)
            nseg = len(pull.segments)
            for layer, views in enumerate(spans):
                for i, view in enumerate(views):
                    arr = _array(view)
                    sends.keep.append(arr)
                    sends.requests.append(ep.tag_send(arr, _tag(u, target.tag, layer * nseg + i)))
        except u.UCXError as exc:
            del self._inflight[pull.transfer_id]
            self._drop_endpoint(target.address)  # ends the sends already posted
            raise UcxSendFailed(f"posting sends to the decode worker failed: {exc}") from exc
        return UcxPosted(pull.transfer_id, lay.dtype, lay.block_shape, sums)

    @property
    def inflight(self) -> int:
        """Transfers whose sends are still tracked (0 once every lease ended and its sends completed)."""
        self._prune()
        return len(self._inflight) + len(self._draining)

    def forget(self, transfer_id: str) -> None:
        """The lease of ``transfer_id`` ended (Done, Release, expiry, refusal). Its blocks may be reused
        at once: a send still reading them can only deliver to a receive that no longer exists (a
        decode thread that gave up drops its worker). Sends still in flight ``_DRAIN_S`` later belong
        to an abandoned pull: their endpoint is closed, which ends them."""
        sends = self._inflight.pop(transfer_id, None)
        if sends is not None and not sends.done():
            self._draining[transfer_id] = (sends, time.monotonic() + _DRAIN_S)
        self._prune()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inflight.clear()
        self._draining.clear()
        for peer in list(self._endpoints):
            self._drop_endpoint(peer)
        self._worker.stop_progress_thread()

    def _prune(self) -> None:
        for tid in [tid for tid, s in self._inflight.items() if s.done()]:
            del self._inflight[tid]
        now = time.monotonic()
        for tid, (sends, until) in list(self._draining.items()):
            if sends.done():
                del self._draining[tid]
            elif now >= until:
                del self._draining[tid]
                log.info("sends of ended transfer %s still in flight: closing their UCX endpoint", tid)
                self._drop_endpoint(sends.peer)
        for peer in [peer for peer, ep in self._endpoints.items() if not ep.alive]:  # decode worker gone
            self._drop_endpoint(peer)

    def _endpoint(self, peer: bytes) -> Any:  # noqa: ANN401
        ep = self._endpoints.get(peer)
        if ep is not None and not ep.alive:  # its decode worker died (error handling on)
            self._drop_endpoint(peer)
            ep = None
        if ep is None:
            u = self._u
            ep = u.UCXEndpoint.create_from_worker_address(
                self._worker, u.UCXAddress.create_from_buffer(peer), self.options.error_handling
            )
            self._endpoints[peer] = ep
            while len(self._endpoints) > _MAX_ENDPOINTS:
                self._drop_endpoint(next(iter(self._endpoints)))
        self._endpoints.move_to_end(peer)
        return ep

    def _drop_endpoint(self, peer: bytes) -> None:
        ep = self._endpoints.pop(peer, None)
        if ep is None:
            return
        try:  # ends what is still in flight on it; waits at most ~1 s (a flush to a peer without error handling)
            ep.close_blocking(period=10**9, max_attempts=1)
        except self._u.UCXError as exc:
            log.info("closing a UCX endpoint: %s", exc)


# -- decode side -------------------------------------------------------------------------------------


@dataclass
class _ThreadWorker:
    worker: Any
    epoll_fd: int
    address: bytes
    tags: itertools.count[int]
    pending: UcxTarget | None = None


class UcxReceiver:
    """``Transport`` for ``ucx`` pulls. One object per puller; each calling thread gets its own UCX
    worker, driven by that thread only. Per pull, on the pulling thread: ``target(layout)`` gives the
    ``UcxTarget`` to put in the Pull, then ``receive(...)`` after the Pull is sent."""

    name = TransportName.UCX.value

    def __init__(self, options: UcxOptions | None = None) -> None:
        self.options = options or UcxOptions()
        self._u = _ucxx()
        self._ctx = _context(self.options)
        self._local = threading.local()

    def target(self, layout: KVLayout) -> UcxTarget:
        tw = self._thread_worker()
        tw.pending = UcxTarget(tw.address, next(tw.tags) % (1 << _TAG_BITS), layout.block_nbytes)
        return tw.pending

    def receive(
        self, sock: zmq.Socket[bytes], pull: wire.Pull, layout: KVLayout, deadline: float, *, codec: wire.Codec
    ) -> int:
        tw = self._thread_worker()
        target, tw.pending = tw.pending, None
        if target is None:
            raise TransferFailed("no UCX target was taken for this pull on this thread")
        u = self._u
        nseg = len(pull.segments)
        requests: list[Any] = []
        try:
            try:
                for layer in range(layout.num_layers):
                    for i, s in enumerate(pull.segments):
                        dest = _array(layout.span(layer, s.local, s.count))
                        requests.append(tw.worker.tag_recv(dest, _tag(u, target.tag, layer * nseg + i)))
                posted = self._wait(tw, sock, pull, requests, deadline, codec)
            except u.UCXError as exc:
                raise TransferFailed(f"ucx: {exc}") from exc
            if posted.dtype != layout.dtype or posted.shape != layout.block_shape:
                raise TransferFailed(
                    f"layout mismatch: remote {posted.dtype}{posted.shape}, local {layout.dtype}{layout.block_shape}"
                )
            if posted.checksums:
                for layer in range(layout.num_layers):
                    for i, s in enumerate(pull.segments):
                        got = checksum(layout.span(layer, s.local, s.count))
                        if got != posted.checksums[layer][i]:
                            raise TransferFailed(f"bad checksum in layer {layer} segment {i}")
        except BaseException:
            requests.clear()
            self._drop(tw)
            raise
        return layout.nbytes(pull.segments)

    def close(self) -> None:
        """Drop the calling thread's worker (other threads' workers go with their threads)."""
        tw = self._local.__dict__.get("tw")
        if tw is not None:
            self._drop(tw)

    def _wait(
        self,
        tw: _ThreadWorker,
        sock: zmq.Socket[bytes],
        pull: wire.Pull,
        requests: list[Any],
        deadline: float,
        codec: wire.Codec,
    ) -> UcxPosted:
        """Until every receive completed and the prefill node's UcxPosted came, or the deadline."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(tw.epoll_fd, zmq.POLLIN)
        posted: UcxPosted | None = None
        left = list(requests)
        while True:
            tw.worker.progress()
            still = []
            for r in left:
                if r.completed:
                    r.check_error()  # a UCXError: truncated (size mismatch), canceled, ...
                else:
                    still.append(r)
            left = still
            while posted is None and sock.poll(0):
                posted = self._control(sock, pull, codec)
            if not left and posted is not None:
                return posted
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TransferFailed(
                    f"timed out: {len(requests) - len(left)} of {len(requests)} segments "
                    f"arrived, {'with' if posted else 'no'} answer from the prefill node"
                )
            if tw.worker.arm():  # nothing left to progress: sleep until UCX or the socket has news
                poller.poll(left_ms)

    @staticmethod
    def _control(sock: zmq.Socket[bytes], pull: wire.Pull, codec: wire.Codec) -> UcxPosted | None:
        data = sock.recv()
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv()
        msg = verify_answer(codec, data)
        if isinstance(msg, wire.Reject) and msg.transfer_id in ("", pull.transfer_id):
            raise TransferFailed(f"prefill node refused: {msg.reason}", refused=True)
        if isinstance(msg, UcxPosted) and msg.transfer_id == pull.transfer_id:
            return msg
        return None  # the tail of an earlier, abandoned pull on this socket

    def _thread_worker(self) -> _ThreadWorker:
        tw = self._local.__dict__.get("tw")
        if tw is None:
            u = self._u
            try:
                worker = u.UCXWorker(self._ctx)
                worker.init_blocking_progress_mode()
                tw = _ThreadWorker(worker, worker.epoll_file_descriptor, worker.address.tobytes(), itertools.count(1))
            except u.UCXError as exc:
                raise TransferFailed(f"ucx: worker did not start: {exc}") from exc
            self._local.tw = tw
        return tw

    def _drop(self, tw: _ThreadWorker) -> None:
        """Destroy a worker that saw a failure: its posted receives (into the cache) die with it."""
        if self._local.__dict__.get("tw") is tw:
            del self._local.tw
        try:
            tw.worker.cancel_inflight_requests(period=0, max_attempts=1)
        except self._u.UCXError as exc:
            log.info("cancelling UCX receives: %s", exc)
        tw.worker = None
