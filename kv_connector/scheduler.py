"""Scheduler half of the tandem connector: decides, per request, what the worker half must do.

Prefill side (request carries ``do_remote_decode``): when the request finishes, keep its blocks
(delay-free) under a lease and hand the decode node the transfer params (``contracts.transfer``):
transfer id, block ids, the block server's endpoints, the host id and the lease deadline.

Layer-wise (the prefill leg also carries ``contracts.transfer.LAYERWISE_ID_KEY``, a transfer id its decode
leg pulls under while the prefill computes): the lease is opened when the request's blocks are first
allocated (``update_state_after_alloc``), the step that computes the last of the prompt tells the worker
which blocks to report layer by layer (``FillSpec``: vLLM fills the last chunk's layers in order, and
earlier chunks are all in place by then), and its end, whatever it is, closes the fill (``FillEnd``):
done, or failed/aborted half-way, which ends the lease and fails the decode node's pull.

Decode side (request carries those params as ``do_remote_prefill``): the admission of remote KV, in
``decode_nodes.admission``: report the prompt as loadable asynchronously, hand the worker the local
blocks to pull into, or release the prefill node's lease when the pull cannot or need not happen.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from contracts.transfer import LAYERWISE_ID_KEY, TransferParams, TransferReport
from decode_nodes.admission import RemoteKvAdmission
from kv_transfer.metadata import FillEnd, FillSpec, LeaseSpec, TandemMetadata
from kv_transfer.settings import ConnectorSettings, host_id

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

log = logging.getLogger("tandem.kv.scheduler")

USED_TIDS_KEPT = 65536
"""How many layer-wise transfer ids a scheduler remembers to refuse their reuse (about 4 MB)."""


class TandemScheduler:
    def __init__(self, settings: ConnectorSettings, engine_id: str, block_size: int) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.block_size = block_size
        self.admission = RemoteKvAdmission(settings, block_size)
        self._leases: list[LeaseSpec] = []
        self._filling: dict[str, tuple[str, Request]] = {}
        """Layer-wise prefills under way: request id → (transfer id, request)."""
        self._filled: set[str] = set()
        """Of those, the ones whose last prompt step was handed to the worker."""
        self._opens: list[tuple[str, str]] = []
        self._used_tids: OrderedDict[str, None] = OrderedDict()
        """Layer-wise transfer ids seen lately (router-chosen, unique): a repeat is refused."""
        self._fill_ends: list[FillEnd] = []

    @property
    def kv_cache_manager(self) -> KVCacheManager | None:
        return self.admission.kv_cache_manager

    @kv_cache_manager.setter
    def kv_cache_manager(self, manager: KVCacheManager | None) -> None:
        self.admission.kv_cache_manager = manager

    # -- decode side -----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.admission.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        tid = params.get(LAYERWISE_ID_KEY)
        if params.get("do_remote_decode") and isinstance(tid, str) and tid:
            if request.request_id in self._filling:  # (a preempted request is allocated again)
                return
            if tid not in self._used_tids:
                self._used_tids[tid] = None
                while len(self._used_tids) > USED_TIDS_KEPT:
                    self._used_tids.popitem(last=False)
                self._filling[request.request_id] = (tid, request)
                self._opens.append((tid, request.request_id))
                return
            # A transfer id this engine has seen: never a second lease under it (its decode leg would
            # pull the first request's blocks). This request is leased whole under its own id instead.
            log.warning("layer-wise id %s reused by request %s: served as a whole pull", tid, request.request_id)
        self.admission.allocated(request, blocks, num_external_tokens)

    def update_connector_output(self, finished_recving: set[str], reports: dict[str, TransferReport] | None) -> None:
        self.admission.outputs(finished_recving, reports)

    # -- both ------------------------------------------------------------------------------------------
    def build_connector_meta(self, *, idle: bool = False, scheduled: dict[str, int] | None = None) -> TandemMetadata:
        """``scheduled``: tokens this step computes per request (before vLLM adds them to its count)."""
        recvs, releases, cancels = self.admission.take()
        leases, self._leases = self._leases, []
        opens, self._opens = self._opens, []
        fill_ends, self._fill_ends = self._fill_ends, []
        fills = []
        for rid, (tid, request) in self._filling.items():
            n = (scheduled or {}).get(rid, 0)
            if n and rid not in self._filled and request.num_computed_tokens + n >= request.num_prompt_tokens:
                self._filled.add(rid)
                fills.append(FillSpec(tid, self._prompt_blocks(request), rid))
        return TandemMetadata(
            recvs=recvs,
            leases=leases,
            releases=releases,
            cancels=cancels,
            idle=idle,
            opens=opens,
            fills=fills,
            fill_ends=fill_ends,
        )

    def _prompt_blocks(self, request: Request) -> list[int]:
        if self.kv_cache_manager is None:
            raise RuntimeError("the scheduler half has no KV cache manager bound")
        ids = list(self.kv_cache_manager.get_block_ids(request.request_id)[0])
        return ids[: -(-request.num_prompt_tokens // self.block_size)]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        decode_side = self.admission.finished(request)
        if decode_side is not None:
            return decode_side
        if not params.get("do_remote_decode"):
            return False, None
        filling = self._filling.pop(request.request_id, None)
        if filling is not None:
            return self._fill_finished(request, filling[0], list(block_ids))
        if (
            request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            or not block_ids
        ):
            return False, None  # aborted or failed prefill: nothing to hand over, free now
        deadline = time.time() + self.settings.lease_s
        self._leases.append(LeaseSpec(request.request_id, list(block_ids), deadline))
        return True, self._handover(request.request_id, list(block_ids), request, deadline)

    def _fill_finished(self, request: Request, tid: str, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A layer-wise prefill ended: close its fill. Its blocks stay allocated until the lease ends
        (the worker reports it as finished sending), whether it ended well or not: a decode node may be
        reading them this very moment."""
        from vllm.v1.request import RequestStatus

        self._filled.discard(request.request_id)
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        reason = "" if ok else f"prefill {request.status.name.lower()}"
        self._fill_ends.append(FillEnd(tid, ok, reason, request.request_id))
        if not ok:
            return True, None
        return True, self._handover(tid, block_ids, request, time.time() + self.settings.lease_s)

    def _handover(self, tid: str, block_ids: list[int], request: Request, deadline: float) -> dict[str, Any]:
        """The transfer params the prefill leg answers with: what its decode node pulls, from where."""
        return TransferParams(
            transfer_id=tid,
            remote_block_ids=block_ids,
            remote_endpoints=self.settings.endpoints,
            remote_host_id=host_id(),
            remote_engine_id=self.engine_id,
            remote_num_tokens=request.num_computed_tokens,
            lease_deadline=deadline,
        ).to_dict()
