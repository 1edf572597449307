"""Scheduler half of the tandem connector: decides, per request, what the worker half must do.

Prefill side (request carries ``do_remote_decode``): when the request finishes, keep its blocks
(delay-free) under a lease and hand the decode node the transfer params: transfer id, block ids, the
block server's endpoints, the host id and the lease deadline.

Decode side (request carries those params as ``do_remote_prefill``): report the prompt as loadable
asynchronously, and after allocation hand the worker the local blocks to pull into. When there is no
room (``reject_when_full``), when the local prefix cache already has every block, when the lease is
already past, or when the request is aborted before its pull, release the prefill node's lease
instead of leaving it to its deadline.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kv_transfer.metadata import LeaseSpec, RecvSpec, ReleaseSpec, TandemMetadata
from kv_transfer.settings import ConnectorSettings, host_id

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

log = logging.getLogger("tandem.kv.scheduler")

PARAMS_VERSION = 1


class TandemScheduler:
    def __init__(self, settings: ConnectorSettings, engine_id: str, block_size: int) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.block_size = block_size
        self.kv_cache_manager: KVCacheManager | None = None
        self._meta = TandemMetadata()
        self._inflight: set[str] = set()
        self._reports: dict[str, dict] = {}
        self._matched_from: dict[str, int] = {}
        """Decode side: the (block-aligned) local hit each pulling request was matched from."""

    # -- decode side -----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or "transfer_id" not in params:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False  # a full local hit: update_state_after_alloc releases the lease
        if params["lease_deadline"] <= time.time():
            self._release(request, "lease already past when the decode node got to it", forget=True)
            return 0, False
        if self.settings.reject_when_full and self._free_blocks() < self._blocks_for(request, num_computed_tokens):
            self._release(request, "decode node has no room", forget=True)
            return 0, False
        self._matched_from[request.request_id] = num_computed_tokens
        return count, True

    def _blocks_for(self, request: Request, num_computed_tokens: int) -> int:
        total = -(-len(request.prompt_token_ids or ()) // self.block_size)
        return total - num_computed_tokens // self.block_size

    def _free_blocks(self) -> int:
        if self.kv_cache_manager is None:
            return 1 << 30
        return self.kv_cache_manager.block_pool.get_num_free_blocks()

    def _release(self, request: Request, reason: str, *, forget: bool) -> None:
        params = request.kv_transfer_params
        log.info("request %s: releasing transfer %s (%s)", request.request_id, params["transfer_id"], reason)
        self._meta.releases.append(ReleaseSpec(params["remote_endpoints"], params["remote_host_id"],
                                               params["transfer_id"], reason))
        if forget:
            params["do_remote_prefill"] = False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or "transfer_id" not in params:
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:
            self._release(request, "decode node had every block cached", forget=False)
            return
        # Align by position: prompt block i on the prefill node is prompt block i here. Blocks before
        # the local hit are ours already; blocks past the prompt (room for the first output tokens)
        # have nothing to receive.
        first = self._matched_from.pop(request.request_id, 0) // self.block_size
        n_prompt = -(-len(request.prompt_token_ids or ()) // self.block_size)
        local = list(blocks.get_block_ids()[0][first:n_prompt])
        remote = list(params["remote_block_ids"])[first:n_prompt]
        if len(remote) != len(local):
            log.warning("request %s: prefill node leased %d prompt blocks, %d needed; the pull will fail and "
                        "the prompt be recomputed", request.request_id, len(remote), len(local))
        self._inflight.add(request.request_id)
        self._meta.recvs.append(RecvSpec(request.request_id, params["transfer_id"], params["remote_endpoints"],
                                         params["remote_host_id"], remote, local, params["lease_deadline"],
                                         params.get("transport")))

    def update_connector_output(self, finished_recving: set[str], reports: dict[str, dict] | None) -> None:
        self._inflight.difference_update(finished_recving)
        if reports:
            self._reports.update(reports)
            while len(self._reports) > 10_000:  # reports of requests aborted mid-pull are never claimed
                del self._reports[next(iter(self._reports))]

    # -- both ------------------------------------------------------------------------------------------
    def build_connector_meta(self, *, idle: bool = False) -> TandemMetadata:
        meta, self._meta = self._meta, TandemMetadata()
        meta.idle = idle
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        report = self._reports.pop(request.request_id, None)
        if report is not None:  # decode side, after its pull: tell the router how the transfer went
            return False, {"tandem_transfer": report}
        if params.get("do_remote_prefill") and "transfer_id" in params:
            # Finished (aborted) before it was ever scheduled: nobody will pull; free the lease now.
            self._release(request, "request ended before its transfer", forget=True)
            return False, None
        if request.request_id in self._inflight and request.status == RequestStatus.FINISHED_ABORTED:
            self._meta.cancels.append(request.request_id)
            return False, None  # vLLM itself delays freeing until the pull reports finished
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED) \
                or not block_ids:
            return False, None  # aborted or failed prefill: nothing to hand over, free now
        deadline = time.time() + self.settings.lease_s
        self._meta.leases.append(LeaseSpec(request.request_id, list(block_ids), deadline))
        return True, {
            "tandem": PARAMS_VERSION,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_endpoints": self.settings.endpoints,
            "remote_host_id": host_id(),
            "remote_engine_id": self.engine_id,
            "remote_num_tokens": request.num_computed_tokens,
            "lease_deadline": deadline,
        }
