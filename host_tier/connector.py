"""``HostTierConnector``: a vLLM KV connector that offloads a request's prompt blocks into the host tier
(``host_tier``, one shared-memory store per host) and loads them back on a later miss, so a prefix the
engine evicted, or lost in a restart, is copied in instead of computed.

Loaded alone or beside ``TandemConnector`` through vLLM's ``MultiConnector`` (the P/D connector first:
a request that carries a remote prefill is its, every other request may hit the tier):

    {"kv_connector": "HostTierConnector", "kv_connector_module_path": "host_tier.connector",
     "kv_role": "kv_both", "kv_connector_extra_config": {"tier_endpoint": "ipc:///tmp/tandem-tier.sock"}}

The sequence, per request:

    scheduler  get_num_new_matched_tokens: Lookup(the prompt's block hashes after the local hit)
               -> n held blocks, never the whole prompt (the last token is always computed)
               update_state_after_alloc: remember (block ids, keys) to load
    worker     start_load_kv (before this step's forward): each block copied straight from its slot
               into the engine's cache, layer by layer, checked by the tier's seqlock + checksum
               (``host_tier.arena``); a block that fails is a load error: vLLM recomputes from it
               (``kv_load_failure_policy=recompute``), the tier forgets it
    scheduler  request_finished: the request's full blocks (prompt and answer: every block whose
               tokens all have KV, i.e. all but the last sampled token's) are kept (delay-free) for
               one more step ...
    worker     ... in which they are copied into the tier (Reserve -> copy -> Commit; blocks the tier
               holds already are not rewritten) and reported finished_sending, and vLLM frees them;
               a request the router marked for retention (``kv_transfer_params["tandem_retain"]``:
               ttl, owner, tenant; ``router.planning.retention``) then has its blocks pinned for the TTL

Exclusive under pressure (the tier's policy, ``host_tier.eviction``): those copies are stored as
spares, since the engine still holds the blocks (it frees them into its prefix cache), and blocks just
loaded become spares; the tier's copy becomes the hot one when the engine evicts the block. vLLM tells a
connector of no eviction, so the scheduler half infers it: it remembers which cached block id holds
which key (from finished requests), and a remembered block id handed to a request at another position
than its key's (``update_state_after_alloc``: every block of a request scheduled from the queue;
``build_connector_meta``: the blocks running requests grew by) was evicted to be reused. Its key is
saved in that step's ``handle_preemptions``, which vLLM runs before anything writes the step's new
blocks (the zeroing of new blocks, loads, the forward): the block still holds the evicted KV. A block
the tier holds already is only refreshed, so most evictions cost one round trip and no copy.

Keys are the engine's own block hashes (``request.block_hashes``, sha256_cbor), the same the router's
fleet index and every tier use. A tier that is down costs a miss, never a failed request: lookups
answer 0 and offloads are skipped while it does not answer (one 0.5 s timeout, then off for
``tier_retry_s``, so a dead tier does not stall the scheduler on every lookup).

The class here is a facade over two halves: ``connector_scheduler.TierScheduler`` (lookups, what to
load and store, the eviction inference) and ``connector_worker.TierWorker`` (the copies between the
engine's cache and the tier's slots), which share one ``connector_meta.TierLink`` (the tier client and
its off-while-down timer) and pass ``connector_meta.HostTierMetadata`` from one to the other each step.

Not done yet: the copies run on the engine's thread inside the step (a 7.5k-token bf16 prompt is
about 170 MB: ~40 ms at the 4 GB/s measured here).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from host_tier.connector_meta import HostTierMetadata, TierLink
from host_tier.connector_scheduler import TierScheduler
from host_tier.connector_worker import TierWorker
from host_tier.settings import layout_from_model
from kv_transfer.layout import KVLayout

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def _dtype_name(vllm_config: VllmConfig) -> str:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype and cache_dtype != "auto":
        return str(cache_dtype)
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


class HostTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        extra = (tc.kv_connector_extra_config if tc else None) or {}
        self.block_size = vllm_config.cache_config.block_size
        layout = layout_from_model(
            Path(vllm_config.model_config.model),
            _dtype_name(vllm_config),
            self.block_size,
            os.environ.get("PYTHONHASHSEED"),
        )
        self._link = TierLink(
            str(extra.get("tier_endpoint", "ipc:///tmp/tandem-tier.sock")),
            layout.fingerprint(),
            timeout_s=float(extra.get("tier_timeout_s", 0.5)),
            retry_s=float(extra.get("tier_retry_s", 10.0)),
        )
        self._num_blocks = kv_cache_config.num_blocks
        self._scheduler = TierScheduler(self._link, self.block_size)
        self._worker = TierWorker(self._link, self._num_blocks)

    @property
    def loaded_blocks(self) -> int:
        return self._worker.loaded_blocks

    @property
    def stored_blocks(self) -> int:
        return self._worker.stored_blocks

    # -- scheduler side --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    # -- worker side -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(KVLayout.from_torch(kv_caches, self._num_blocks))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Runs before this step writes any block (vLLM's hook for saving what is about to be
        overwritten): the evicted blocks still hold their keys' KV, and go to the tier hot."""
        if isinstance(kv_connector_metadata, HostTierMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HostTierMetadata)
        self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # offloads copy whole blocks from the cache after their request ends

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished_sending() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def shutdown(self) -> None:
        self._link.close()
