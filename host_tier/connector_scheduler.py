"""The scheduler half of the host-tier connector (``host_tier.connector``): asks the tier how much of a
waiting request's prompt it holds, remembers which blocks to load and which finished requests' blocks
to store, and infers the engine's evictions (vLLM tells a connector of none): a remembered cached block
handed out at another position than its key's was evicted to be reused, and its key goes to the worker
half in that step's metadata, saved before anything writes the block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from contracts.errors import ConfigError
from host_tier.connector_meta import BlockCopy, HostTierMetadata, TierLink, parse_retain

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request


class TierScheduler:
    def __init__(self, link: TierLink, block_size: int) -> None:
        self._link = link
        self.block_size = block_size
        self._pending_load: dict[str, tuple[int, list[int]]] = {}  # request -> (first block index, tier slots)
        self._loads: list[BlockCopy] = []
        self._stores: list[BlockCopy] = []
        self._cached: dict[int, bytes] = {}
        """block id -> the key it holds, for blocks of finished requests (vLLM's prefix cache), until the
        block is seen handed out again (evicted, or hit where the key says)."""
        self._evicted: BlockCopy = BlockCopy("", [], [])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        tier = self._link.up()
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
            slots = tier.slots(keys)  # handed to the worker: its load asks the tier nothing more
        except ConfigError as exc:
            self._link.down(exc)
            return 0, False
        if not slots:
            return 0, False
        self._pending_load[request.request_id] = (first, slots)
        return len(slots) * self.block_size, False

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
        first, slots = pending
        n = min(len(slots), num_external_tokens // self.block_size)
        keys = [bytes(h) for h in request.block_hashes[first : first + n]]
        self._loads.append(BlockCopy(request.request_id, list(block_ids[first : first + n]), keys, slots=slots[:n]))

    def _note_evicted(self, block_id: int) -> None:
        key = self._cached.pop(block_id)
        self._evicted.block_ids.append(block_id)
        self._evicted.keys.append(key)

    def build_connector_meta(self, scheduler_output: Any) -> HostTierMetadata:
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
        if n == 0 or self._link.up() is None:
            return False, None
        self._stores.append(BlockCopy(request.request_id, ids[:n], keys, parse_retain(request.kv_transfer_params)))
        return True, None  # held one more step, while the worker copies them out
