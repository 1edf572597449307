"""Worker half of the tandem connector: owns the block server (prefill side), the puller (decode
side) and the lease table, and turns their outcomes into what vLLM's worker contract expects:
``finished_sending`` (leases ended: free the prefill blocks), ``finished_recving`` and
``failed_recving`` (pulls ended), and the local blocks of failed pulls as load errors (vLLM then
recomputes them or fails the request, per ``kv_load_failure_policy``)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from contracts.transfer import TransferReport
from decode_nodes.puller import Puller, PullJob, PullOutcome
from kv_connector.layer_gate import LayerGate
from kv_transfer import wire
from kv_transfer.config import LAYERWISE_TRANSPORTS, ONE_HOST_TRANSPORTS, TransportName
from kv_transfer.hugepages import advise_huge_pages
from kv_transfer.layout import KVLayout
from kv_transfer.metadata import TandemMetadata, TransferReports
from kv_transfer.settings import ConnectorSettings
from kv_transfer.stats import COUNTS, LISTS, TransferStats
from prefill_nodes.block_server import BlockServer
from prefill_nodes.lease import LeaseError, LeaseTable

log = logging.getLogger("tandem.kv.worker")


class TandemWorker:
    def __init__(self, settings: ConnectorSettings, engine_id: str, num_blocks: int) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        self.stats = TransferStats()
        self._activity = threading.Event()
        """Set when a lease ends or a pull finishes: what an idle step waits for."""
        self._idle = False
        self.leases = LeaseTable(holder=engine_id, on_end=self._activity.set)
        self.server: BlockServer | None = None
        self.puller: Puller | None = None
        self._seen_finished: set[str] = set()
        self._ended_unreported: set[str] = set()
        self._load_errors: set[int] = set()
        self._reports: dict[str, TransferReport] = {}
        self._last_gauges = (0, 0, 0, 0)
        self._layer_index: dict[str, int] = {}
        self._request_of: dict[str, str] = {}
        """Layer-wise leases: transfer id → the prefill request holding its blocks (vLLM frees blocks
        by request id; those leases are named by the sender's transfer id)."""
        self._step_fills: list[tuple[str, list[int]]] = []
        """Layer-wise leases whose last prompt chunk this step computes: report each layer written."""
        self._step_meta: TandemMetadata | None = None
        self._saved: set[int] = set()
        self._ready = 0
        """This step's layers written, and how many of the first layers are all written."""
        self.gate = LayerGate(settings.split_stall_s)
        """Split prefills' pulls that this step's attention layers wait for (``kv_connector.layer_gate``)."""
        self._split: set[str] = set()
        """Requests whose split pull has not reported its outcome yet: vLLM did not wait for it as a
        whole, so it is no finished or failed receive of vLLM's (its failure went out as load errors)."""

    def register(self, layout: KVLayout, layer_names: list[str] | None = None) -> None:
        self._layer_index = {name: i for i, name in enumerate(layer_names or [])}
        if self.settings.huge_pages:
            outcomes = {advise_huge_pages(layout.address(i), layout.layers[i].nbytes) for i in range(layout.num_layers)}
            log.info("KV cache huge pages: %s", ", ".join(sorted(outcomes)))
        codec = self.settings.codec()  # ConfigError here stops the engine: no unauthenticated server
        self.server = BlockServer(
            layout, self.leases, self.settings.bind_endpoints, self.stats, codec, faults=self.settings.faults
        )
        self.server.start()
        self.puller = Puller(
            layout,
            self.stats,
            codec,
            threads=self.settings.pull_threads,
            on_outcome=self._activity.set,
            shm_split=self.settings.shm_split,
            shm_split_min_bytes=self.settings.shm_split_min_bytes,
        )
        log.info(
            "tandem connector: %d layers, %d blocks of %d bytes; block server on %s",
            layout.num_layers,
            layout.layers[0].shape[0],
            layout.block_nbytes,
            self.settings.bind_endpoints,
        )

    def start(self, meta: TandemMetadata) -> None:
        """Act on one step's metadata; never blocks on the network."""
        assert self.server is not None and self.puller is not None, "register_kv_caches was not called"
        self._idle = meta.idle
        self.gate.begin_step()
        for lease in meta.leases:
            self.server.offer(lease.transfer_id, lease.block_ids, lease.deadline)
        self.begin_step(meta)
        for end in meta.fill_ends:
            if not self._owns(end.transfer_id, end.request_id):
                continue
            if end.ok:
                self.server.fill(end.transfer_id, self.server.layout.num_layers, done=True)
            else:
                self.server.abort_fill(end.transfer_id, end.reason)
        for release in meta.releases:
            self.puller.release(
                self._endpoint(release.endpoints, self.settings.choose_transport(release.host_id)),
                release.transfer_id,
                release.reason,
            )
        for recv in meta.recvs:
            transport = self.settings.choose_transport(recv.host_id, recv.transport)
            # A layer-wise pull's deadline is a stall timeout (every sign of progress restarts it).
            deadline = time.monotonic() + (
                self.settings.transfer_timeout_s
                if recv.layerwise
                else min(self.settings.transfer_timeout_s, max(0.0, recv.lease_deadline - time.time()))
            )
            if recv.layerwise and transport not in LAYERWISE_TRANSPORTS:
                transport = TransportName.TCP.value  # layer-wise pulls are served over frames or kernel copies only
            watch = None
            if recv.split:
                self._split.add(recv.request_id)
                watch = self.gate.open(recv.request_id, recv.local_block_ids)
            try:
                segments = wire.segments_of(recv.remote_block_ids, recv.local_block_ids)
            except ValueError as exc:  # the prefill node holds fewer blocks than we need: recompute
                log.warning("pull %s for %s not started: %s", recv.transfer_id, recv.request_id, exc)
                if watch is not None:
                    watch.ended(False)
                self.puller.outcomes.put(PullOutcome(recv.request_id, False, recv.local_block_ids, reason=str(exc)))
                self.puller.release(self._endpoint(recv.endpoints, transport), recv.transfer_id, str(exc))
                continue
            self.puller.submit(
                PullJob(
                    recv.request_id,
                    recv.transfer_id,
                    self._endpoint(recv.endpoints, transport),
                    transport,
                    segments,
                    recv.local_block_ids,
                    deadline,
                    checksum=self.settings.checksum_for(transport),
                    layerwise=recv.layerwise,
                    watch=watch,
                )
            )
        for request_id in meta.cancels:
            self.puller.cancel(request_id)

    def begin_step(self, meta: TandemMetadata) -> None:
        """Open this step's layer-wise leases and note which of them end their prompt in it. Run at the
        first ``save_kv_layer`` of the step or at ``start``, whichever comes first: vLLM calls
        ``start_load_kv`` after the forward when no load is synchronous, too late for the layers."""
        if meta is self._step_meta or self.server is None:
            return
        self._step_meta = meta
        for tid, request_id in meta.opens:
            try:
                self.server.open_fill(tid, self.settings.lease_s)
            except LeaseError as exc:  # a sender reused a transfer id: no lease; its pull is refused
                log.warning("layer-wise lease for request %s not opened: %s", request_id, exc)
                # No lease will end under this request, yet the scheduler keeps its blocks until one is
                # reported: report it finished as soon as vLLM says the request ended.
                self._ended_unreported.add(request_id)
                continue
            self._request_of[tid] = request_id
        self._step_fills = [(f.transfer_id, f.block_ids) for f in meta.fills if self._owns(f.transfer_id, f.request_id)]
        self._saved, self._ready = set(), 0

    def _owns(self, transfer_id: str, request_id: str) -> bool:
        """Whether this request opened the layer-wise lease ``transfer_id`` (not another one that a
        sender gave the same id, whose lease must not be touched)."""
        return self._request_of.get(transfer_id) == request_id

    def layer_saved(self, layer_name: str, meta: TandemMetadata) -> None:
        """``save_kv_layer``: the engine has written this layer for this step (``meta``: the step's
        metadata); a layer-wise prefill ending in this step may now be served that far."""
        self.begin_step(meta)
        if not self._step_fills or self.server is None:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        self._saved.add(layer)
        ready = self._ready
        while ready in self._saved:  # the count of leading layers written, whatever order they came in
            ready += 1
        if ready == self._ready:
            return
        first, self._ready = self._ready == 0, ready
        for tid, block_ids in self._step_fills:
            self.server.fill(tid, ready, block_ids if first else None)

    @staticmethod
    def _endpoint(endpoints: dict[str, str], transport: str) -> str:
        # shm moves data by cross-memory attach but still talks over the one-host socket
        return endpoints[TransportName.IPC if transport in ONE_HOST_TRANSPORTS else TransportName.TCP]

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        self._wait_if_idle()
        # vLLM accepts a finished_sending id only once the scheduler has told us the request
        # finished (this call or an earlier one); a lease can end before that (an expired one).
        self._seen_finished |= finished_req_ids
        ended = self.leases.take_ended()
        self.stats.record_outcomes([lease.state.value for lease in ended])
        self._ended_unreported |= {self._request_of.pop(lease.transfer_id, lease.transfer_id) for lease in ended}
        sending = self._ended_unreported & self._seen_finished
        self._ended_unreported -= sending
        self._seen_finished -= sending
        recving: set[str] = set()
        failed: set[str] = set()
        assert self.puller is not None
        while True:
            try:
                outcome = self.puller.outcomes.get_nowait()
            except queue.Empty:
                break
            self._reports[outcome.request_id] = outcome.report()
            if outcome.request_id in self._split:
                self._split.discard(outcome.request_id)  # its step waited layer by layer (wait_layer)
                continue
            recving.add(outcome.request_id)
            if not outcome.ok:
                failed.add(outcome.request_id)
                self._load_errors.update(outcome.local_block_ids)
        return sending, recving, failed

    def wait_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: hold this layer's attention until the split pulls of this step have
        written it; the blocks of a pull that failed or stalled become load errors (recomputed) and
        the pull is abandoned."""
        if not len(self.gate):
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for entry in self.gate.wait(layer):
            log.warning("split pull for %s gave out at layer %d: its prefix is recomputed", entry.request_id, layer)
            self._load_errors.update(entry.block_ids)
            if self.puller is not None:
                self.puller.cancel(entry.request_id)

    def _wait_if_idle(self) -> None:
        """On a step that computed nothing, sleep until a transfer ends (or ``idle_wait_ms``; while
        a pull of this node's is in flight, ``pull_wait_ms``) rather than return to vLLM's loop,
        which would step again at once: a spinning engine takes the core its own pull or send
        threads need. Clear, then look, then wait: an end signalled after the look still wakes the
        wait."""
        if not self._idle or self.settings.idle_wait_ms <= 0:
            return
        self._activity.clear()
        assert self.puller is not None
        if self.leases.has_ended() or not self.puller.outcomes.empty():
            return
        if self.puller.in_flight():  # this node's own pull: what the step waits for (pull_wait_ms)
            self._activity.wait(max(self.settings.pull_wait_ms, self.settings.idle_wait_ms) / 1000)
        elif len(self.leases):
            self._activity.wait(self.settings.idle_wait_ms / 1000)

    def take_reports(self) -> TransferReports | None:
        if not self._reports:
            return None
        out, self._reports = TransferReports(self._reports), {}
        return out

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def stats_snapshot(self) -> dict[str, Any] | None:
        """What accumulated since the last step, or None when nothing did (vLLM then sends nothing)."""
        pulls = 0 if self.puller is None else self.puller.in_flight()
        gauges = (len(self.leases), self.leases.leased_blocks(), self.leases.sending(), pulls)
        snap = self.stats.snapshot(*gauges)
        moved = any(snap[k] for k in (*LISTS, *COUNTS, "lease_outcomes"))
        if not moved and gauges == self._last_gauges:
            return None
        self._last_gauges = gauges
        snap["changed"] = True
        return snap

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.puller is not None:
            self.puller.close()
