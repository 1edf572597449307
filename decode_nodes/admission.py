"""Admission of remote KV on a decode node: the decode side of the connector's scheduler half
(``kv_connector.scheduler`` delegates to it).

A request whose ``kv_transfer_params`` name a transfer (``contracts.transfer.TransferParams``, version
checked first) reports its prompt as loadable asynchronously, and after allocation hands the worker the
local blocks to pull into. When there is no room (``reject_when_full``), when the local prefix cache
already has every block, when the lease is already past, or when the request is aborted before its
pull, the prefill node's lease is released instead of being left to its deadline. Params of another
version, or malformed ones, are refused with an error in the log naming both versions: the request is
prefilled here (nothing is pulled, nothing released: we cannot trust their endpoints), and the lease
ends at its deadline on the prefill node.

A peer prefix fetch (``TransferParams.prefix_tokens``, ``router.planning.peer_fetch``) loads only the prompt's
first blocks from the peer, from the local hit on; vLLM then computes the rest of the prompt here as
for any partial hit (its scheduler counts the loaded tokens as computed once the pull ends).

A split prefill (``TransferParams.split``: layer-wise, a prefix the peer computes at the same time) is
reported as loaded synchronously: vLLM schedules the rest of the prompt in the same step, and the
worker's attention layers wait for the prefix layer by layer (``kv_connector.layer_gate``). Its pull
then has nothing to cancel: it ends within the step that needs it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from contracts.errors import TandemError
from contracts.transfer import TransferParams, TransferReport, block_key, is_transfer_params
from kv_transfer.metadata import RecvSpec, ReleaseSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

    from kv_transfer.settings import ConnectorSettings

log = logging.getLogger("tandem.kv.admission")

MAX_UNCLAIMED_REPORTS = 10_000
"""Reports of requests aborted mid-pull are never claimed: the oldest beyond this are dropped."""


class RemoteKvAdmission:
    def __init__(self, settings: ConnectorSettings, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.kv_cache_manager: KVCacheManager | None = None
        self.recvs: list[RecvSpec] = []
        self.releases: list[ReleaseSpec] = []
        self.cancels: list[str] = []
        """What the next step's metadata carries to the worker (taken by ``take``)."""
        self.refused_params = 0
        """Requests whose transfer params were of another version or malformed."""
        self._inflight: set[str] = set()
        self._reports: dict[str, TransferReport] = {}
        self._matched_from: dict[str, int] = {}
        """The (block-aligned) local hit each pulling request was matched from."""

    def take(self) -> tuple[list[RecvSpec], list[ReleaseSpec], list[str]]:
        out = self.recvs, self.releases, self.cancels
        self.recvs, self.releases, self.cancels = [], [], []
        return out

    def _pending(self, request: Request) -> TransferParams | None:
        """The request's transfer params while it still waits to pull; None for any other request. Params
        this node cannot read are refused once: logged, counted, and the request prefilled here."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not is_transfer_params(params):
            return None
        try:
            return TransferParams.from_dict(params)
        except TandemError as exc:
            params["do_remote_prefill"] = False
            self.refused_params += 1
            log.error(
                "request %s: kv_transfer_params refused, prefilling here instead: %s", request.request_id, exc.message
            )
            return None

    def match(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: how many prompt tokens will come from the prefill node."""
        params = self._pending(request)
        if params is None:
            return 0, False
        loaded = self._loaded_tokens(request, params)
        if params.prefix_tokens is not None and not self._same_prefix(request, params, loaded):
            self._release(request, params, "the peer's prefix is not this prompt's (tokens or salt differ)")
            return 0, False
        count = loaded - num_computed_tokens
        if count <= 0:
            # Held here already. Released now, not at allocation, so that a connector asked after this
            # one (the host tier, under MultiConnector) may still load what it holds past that.
            self._release(request, params, "the node holds the blocks itself")
            return 0, False
        if params.lease_deadline <= time.time():
            self._release(request, params, "lease already past when the decode node got to it")
            return 0, False
        if self.settings.reject_when_full and self._free_blocks() < self._blocks_for(request, num_computed_tokens):
            self._release(request, params, "decode node has no room")
            return 0, False
        self._matched_from[request.request_id] = num_computed_tokens
        return count, not _split(params)

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """``update_state_after_alloc``: hand the worker the local blocks to pull into."""
        params = self._pending(request)
        if params is None:
            return
        _flags(request)["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:
            self._release(request, params, "decode node had every block cached", forget=False)
            return
        # Align by position: prompt block i on the prefill node is prompt block i here. Blocks before
        # the local hit are ours already; blocks past the prompt (room for the first output tokens)
        # have nothing to receive.
        first = self._matched_from.pop(request.request_id, 0) // self.block_size
        n_prompt = -(-self._loaded_tokens(request, params) // self.block_size)
        local = list(blocks.get_block_ids()[0][first:n_prompt])
        # Layer-wise: the prefill has not allocated its blocks yet when we ask; ask by position.
        remote = list(range(first, n_prompt)) if params.layerwise else params.remote_block_ids[first:n_prompt]
        if len(remote) != len(local):
            log.warning(
                "request %s: prefill node leased %d prompt blocks, %d needed; the pull will fail and "
                "the prompt be recomputed",
                request.request_id,
                len(remote),
                len(local),
            )
        split = _split(params)
        if not split:  # a synchronous pull ends within its step: nothing to cancel later
            self._inflight.add(request.request_id)
        self.recvs.append(
            RecvSpec(
                request.request_id,
                params.transfer_id,
                params.remote_endpoints,
                params.remote_host_id,
                remote,
                local,
                params.lease_deadline,
                params.transport,
                params.layerwise,
                split,
            )
        )

    def outputs(self, finished_recving: set[str], reports: dict[str, TransferReport] | None) -> None:
        """``update_connector_output``: pulls that ended, and how they went."""
        self._inflight.difference_update(finished_recving)
        if reports:
            self._reports.update(reports)
            while len(self._reports) > MAX_UNCLAIMED_REPORTS:
                del self._reports[next(iter(self._reports))]

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None] | None:
        """``request_finished`` for the decode side; None when the request is none of its business."""
        from vllm.v1.request import RequestStatus

        report = self._reports.pop(request.request_id, None)
        if report is not None:  # after its pull: tell the router how the transfer went
            return False, {"tandem_transfer": report.to_dict()}
        params = self._pending(request)
        if params is not None:
            # Finished (aborted) before it was ever scheduled: nobody will pull; free the lease now.
            self._release(request, params, "request ended before its transfer")
            return False, None
        if request.request_id in self._inflight and request.status == RequestStatus.FINISHED_ABORTED:
            self.cancels.append(request.request_id)
            return False, None  # vLLM itself delays freeing until the pull reports finished
        return None

    def _loaded_tokens(self, request: Request, params: TransferParams) -> int:
        """How many leading prompt tokens come from the peer: the whole prompt (P/D), or a prefix fetch's
        whole blocks, never reaching the prompt's last token (which vLLM always computes)."""
        n = len(request.prompt_token_ids or ())
        if params.prefix_tokens is None:
            return n
        bs = self.block_size
        return min(max(params.prefix_tokens, 0), n - 1) // bs * bs

    def _same_prefix(self, request: Request, params: TransferParams, loaded: int) -> bool:
        """Whether this prompt's own chain hash of the prefix's last block is the one the router sent."""
        n = loaded // self.block_size
        hashes = getattr(request, "block_hashes", None) or []
        if n <= 0 or len(hashes) < n or params.prefix_key is None:
            return False
        return block_key(bytes(hashes[n - 1])) == params.prefix_key

    def _blocks_for(self, request: Request, num_computed_tokens: int) -> int:
        total = -(-len(request.prompt_token_ids or ()) // self.block_size)
        return total - num_computed_tokens // self.block_size

    def _free_blocks(self) -> int:
        if self.kv_cache_manager is None:
            return 1 << 30
        return int(self.kv_cache_manager.block_pool.get_num_free_blocks())

    def _release(self, request: Request, params: TransferParams, reason: str, *, forget: bool = True) -> None:
        log.info("request %s: releasing transfer %s (%s)", request.request_id, params.transfer_id, reason)
        self.releases.append(ReleaseSpec(params.remote_endpoints, params.remote_host_id, params.transfer_id, reason))
        if forget:
            _flags(request)["do_remote_prefill"] = False


def _split(params: TransferParams) -> bool:
    """Whether these params ask for a synchronous, layer-by-layer load of a prefix the peer computes."""
    return params.split and params.layerwise and params.prefix_tokens is not None


def _flags(request: Request) -> dict[str, Any]:
    """The request's own params dict, whose flags we flip in place (vLLM keeps and re-reads it)."""
    params = request.kv_transfer_params
    if params is None:
        raise ValueError(f"request {request.request_id} has no kv_transfer_params")
    return params
