"""Scheduler half of the tandem connector: decides, per request, what the worker half must do.

Prefill side (request carries ``do_remote_decode``): when the request finishes, keep its blocks
(delay-free) under a lease and hand the decode node the transfer params (``contracts.transfer``):
transfer id, block ids, the block server's endpoints, the host id and the lease deadline.

Decode side (request carries those params as ``do_remote_prefill``): the admission of remote KV, in
``decode_nodes.admission``: report the prompt as loadable asynchronously, hand the worker the local
blocks to pull into, or release the prefill node's lease when the pull cannot or need not happen.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from contracts.transfer import TransferParams, TransferReport
from decode_nodes.admission import RemoteKvAdmission
from kv_transfer.metadata import LeaseSpec, TandemMetadata
from kv_transfer.settings import ConnectorSettings, host_id

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

log = logging.getLogger("tandem.kv.scheduler")


class TandemScheduler:
    def __init__(self, settings: ConnectorSettings, engine_id: str, block_size: int) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.block_size = block_size
        self.admission = RemoteKvAdmission(settings, block_size)
        self._leases: list[LeaseSpec] = []

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
        self.admission.allocated(request, blocks, num_external_tokens)

    def update_connector_output(self, finished_recving: set[str], reports: dict[str, TransferReport] | None) -> None:
        self.admission.outputs(finished_recving, reports)

    # -- both ------------------------------------------------------------------------------------------
    def build_connector_meta(self, *, idle: bool = False) -> TandemMetadata:
        recvs, releases, cancels = self.admission.take()
        leases, self._leases = self._leases, []
        return TandemMetadata(recvs=recvs, leases=leases, releases=releases, cancels=cancels, idle=idle)

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
        if (
            request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            or not block_ids
        ):
            return False, None  # aborted or failed prefill: nothing to hand over, free now
        deadline = time.time() + self.settings.lease_s
        self._leases.append(LeaseSpec(request.request_id, list(block_ids), deadline))
        return True, TransferParams(
            transfer_id=request.request_id,
            remote_block_ids=list(block_ids),
            remote_endpoints=self.settings.endpoints,
            remote_host_id=host_id(),
            remote_engine_id=self.engine_id,
            remote_num_tokens=request.num_computed_tokens,
            lease_deadline=deadline,
        ).to_dict()
