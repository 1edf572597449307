"""``HostTierConnector``: a vLLM KV connector that offloads a request's prompt blocks into the host tier
(``host_tier``, one shared-memory store per host) and loads them back on a later miss, so a prefix the
engine evicted, or lost in a restart, is copied in instead of computed.

Loaded alone or beside ``TandemConnector`` through vLLM's ``MultiConnector`` (the P/D connector first:
a request that carries a remote prefill is its, every other request may hit the tier):

    {"kv_connector": "HostTierConnector", "kv_connector_module_path": "kv_transfer.host_tier_connector",
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
               ttl, owner, tenant; ``router.retention``) then has its blocks pinned for the TTL

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

Not done yet: the copies run on the engine's thread inside the step (a 7.5k-token bf16 prompt is
about 170 MB: ~40 ms at the 4 GB/s measured here).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from contracts.errors import ConfigError
from host_tier.client import TierClient, TierUnavailable
from host_tier.settings import layout_from_model
from kv_transfer.layout import KVLayout

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("tandem.kv.host_tier")


class Retain(msgspec.Struct, frozen=True):
    """``kv_transfer_params["tandem_retain"]``, as the router writes it (checked here, at the boundary)."""

    ttl_s: float
    owner: str
    tenant: str = ""


def _retain(params: dict[str, Any] | None) -> Retain | None:
    raw = (params or {}).get("tandem_retain")
    if raw is None:
        return None
    try:
        hint = msgspec.convert(raw, Retain)
    except msgspec.ValidationError as exc:
        log.warning("tandem_retain ignored: %s", exc)
        return None
    return hint if 0 < hint.ttl_s <= 86_400 and 0 < len(hint.owner) <= 256 else None


@dataclass
class BlockCopy:
    request_id: str
    block_ids: list[int]
    keys: list[bytes]
    retain: Retain | None = None


@dataclass
class HostTierMetadata(KVConnectorMetadata):
    loads: list[BlockCopy] = field(default_factory=list)
    stores: list[BlockCopy] = field(default_factory=list)
    evicted: BlockCopy | None = None
    """Blocks the engine evicted this step to reuse them, with the keys they still hold until the step
    writes them: saved to the tier (hot) in ``handle_preemptions``, before any write."""


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
        import os

        self.block_size = vllm_config.cache_config.block_size
        layout = layout_from_model(
            Path(vllm_config.model_config.model),
            _dtype_name(vllm_config),
            self.block_size,
            os.environ.get("PYTHONHASHSEED"),
        )
        endpoint = str(extra.get("tier_endpoint", "ipc:///tmp/tandem-tier.sock"))
        self._tier: TierClient | None = None
        try:
            # 10 s to find the tier at start (it may still be starting); then a short timeout: a lookup
            # runs on the scheduler's thread for every waiting request.
            self._tier = TierClient(endpoint, layout.fingerprint(), timeout_s=10.0)
            self._tier.set_timeout(float(extra.get("tier_timeout_s", 0.5)))
        except TierUnavailable as exc:  # no tier answering: serve without it (a miss costs a prefill)
            log.warning("host tier off: %s", exc.message)
        # Any other ConfigError (a tier of another layout) ends the start with its message: a tier the
        # engine could never hit is a configuration error, not a silent 0% hit rate.
        self._retry_s = float(extra.get("tier_retry_s", 10.0))
        self._down_until = 0.0
        self._num_blocks = kv_cache_config.num_blocks
        self._kv: KVLayout | None = None
        # scheduler side
        self._pending_load: dict[str, tuple[int, int]] = {}  # request -> (first block index, count)
        self._loads: list[BlockCopy] = []
        self._stores: list[BlockCopy] = []
        self._cached: dict[int, bytes] = {}
        """block id -> the key it holds, for blocks of finished requests (vLLM's prefix cache), until the
        block is seen handed out again (evicted, or hit where the key says)."""
        self._evicted: BlockCopy = BlockCopy("", [], [])
        # worker side
        self._stored: set[str] = set()
        self._load_errors: set[int] = set()
        self.loaded_blocks = 0
        self.stored_blocks = 0

    def _up(self) -> TierClient | None:
        """The tier, unless it is off or failed to answer within the last ``tier_retry_s``: a tier that is
        down costs one timeout per ``tier_retry_s``, not one per lookup."""
        if self._tier is None or time.monotonic() < self._down_until:
            return None
        return self._tier

    def _down(self, exc: ConfigError) -> None:
        self._down_until = time.monotonic() + self._retry_s
        log.warning("host tier not answering (%s): off for %.0f s", exc.message, self._retry_s)

    # -- scheduler side --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        tier = self._up()
        # A decode leg's prompt comes from its prefill node (the P/D connector before this one claims
        # it): no lookup round trip on its way to the first token.
        if tier is None or (request.kv_transfer_params or {}).get("do_remote_prefill"):
            return 0, False
        first = num_computed_tokens // self.block_size
        # Never the last prompt token: the engine computes it for the first output's logits.
        last = (request.num_prompt_tokens - 1) // self.block_size
        keys = [bytes(h) for h in request.block_hashes[first:last]]
        if not keys:
            return 0, False
        try:
            n = tier.lookup(keys)
        except ConfigError as exc:
            self._down(exc)
            return 0, False
        if n == 0:
            return 0, False
        self._pending_load[request.request_id] = (first, n)
        return n * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0] if blocks.blocks else []
        # Every block of a request scheduled from the queue: prefix hits keep their keys, any other
        # remembered block was evicted for it.
        for i, block_id in enumerate(block_ids):
            key = self._cached.get(block_id)
            if key is not None and not (i < len(request.block_hashes) and bytes(request.block_hashes[i]) == key):
                self._note_evicted(block_id)
        pending = self._pending_load.pop(request.request_id, None)
        if pending is None or num_external_tokens == 0:
            return
        first, n = pending
        n = min(n, num_external_tokens // self.block_size)
        keys = [bytes(h) for h in request.block_hashes[first : first + n]]
        self._loads.append(BlockCopy(request.request_id, list(block_ids[first : first + n]), keys))

    def _note_evicted(self, block_id: int) -> None:
        key = self._cached.pop(block_id)
        self._evicted.block_ids.append(block_id)
        self._evicted.keys.append(key)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        # The blocks running requests grew by this step are new: a remembered one among them was evicted.
        # (Resumed requests came through update_state_after_alloc, which told their hits apart.)
        cached_reqs = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids in zip(cached_reqs.req_ids, cached_reqs.new_block_ids, strict=True):
            if new_ids is None or req_id in cached_reqs.resumed_req_ids:
                continue
            for block_id in new_ids[0]:
                if block_id in self._cached:
                    self._note_evicted(block_id)
        evicted = self._evicted if self._evicted.block_ids else None
        meta = HostTierMetadata(loads=self._loads, stores=self._stores, evicted=evicted)
        self._loads, self._stores, self._evicted = [], [], BlockCopy("", [], [])
        return meta

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        self._pending_load.pop(request.request_id, None)
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        ids = list(block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple)) else block_ids or ())
        # Every block whose tokens all have KV: the last sampled token was never fed, so not its.
        n = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes), len(ids))
        keys = [bytes(h) for h in request.block_hashes[:n]]
        self._cached.update(zip(ids[:n], keys, strict=True))  # vLLM keeps them cached once freed
        if n == 0 or self._up() is None:
            return False, None
        self._stores.append(BlockCopy(request.request_id, ids[:n], keys, _retain(request.kv_transfer_params)))
        return True, None  # held one more step, while the worker copies them out

    # -- worker side -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = KVLayout.from_torch(kv_caches, self._num_blocks)

    def _parts(self, block_id: int) -> list[np.ndarray]:
        assert self._kv is not None
        return [layer[block_id] for layer in self._kv.layers]

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Runs before this step writes any block (vLLM's hook for saving what is about to be
        overwritten): the evicted blocks still hold their keys' KV, and go to the tier hot."""
        if isinstance(kv_connector_metadata, HostTierMetadata) and kv_connector_metadata.evicted is not None:
            self._store(kv_connector_metadata.evicted, cold=False)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HostTierMetadata)
        for copy in meta.stores:
            self._store(copy, cold=True)  # the engine keeps them cached: the tier's copy is the spare
            self._stored.add(copy.request_id)  # always: vLLM frees the blocks only once it is reported
        for copy in meta.loads:
            self._load(copy)

    def _load(self, copy: BlockCopy) -> None:
        """Fill the claimed blocks, or report them as load errors: a claimed block left unfilled would
        be computed on from whatever the cache held, so every path ends in one or the other."""
        tier = self._up()
        found: list[int] = []
        if tier is not None and self._kv is not None:
            try:
                found = tier.slots(copy.keys)
            except ConfigError as exc:
                self._down(exc)
        loaded = 0
        for i, block_id in enumerate(copy.block_ids):
            ok = (
                i < len(found)
                and tier is not None
                and tier.arena.read_scatter(found[i], copy.keys[i], self._parts(block_id))
            )
            if not ok:
                # This block and the rest are recomputed (vLLM recomputes from the first failed block).
                self._load_errors.update(copy.block_ids[i:])
                if tier is not None and i < len(found):
                    try:
                        tier.forget([copy.keys[i]])
                    except ConfigError as exc:
                        self._down(exc)
                break
            loaded += 1
        self.loaded_blocks += loaded
        if loaded and tier is not None:
            try:
                tier.demote(copy.keys[:loaded])  # this engine holds them now: the tier's are the spares
            except ConfigError as exc:
                self._down(exc)

    def _store(self, copy: BlockCopy, *, cold: bool) -> None:
        tier = self._up()
        if tier is None or self._kv is None:
            return
        try:
            self.stored_blocks += tier.put_parts(copy.keys, [self._parts(b) for b in copy.block_ids], cold=cold)
            if copy.retain is not None:
                r = copy.retain
                tier.pin(copy.keys, r.ttl_s, r.owner, r.tenant)
        except ConfigError as exc:
            self._down(exc)
        except ValueError as exc:  # a block larger than the tier's slots: another layout slipped through
            log.warning("host tier offload skipped: %s", exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # offloads copy whole blocks from the cache after their request ends

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._stored = self._stored, set()
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._tier is not None:
            self._tier.close()
