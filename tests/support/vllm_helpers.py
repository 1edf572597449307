"""Builders that drive vLLM's own prefix-cache code (no engine): its Request block hasher and its
BlockPool, which emits the BlockStored / BlockRemoved / AllBlocksCleared events an engine publishes."""

from __future__ import annotations

import itertools

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

_ids = itertools.count()


class EnginePrefixCache:
    """vLLM's scheduler-side prefix cache for one KV cache group, as an engine with
    ``--prefix-caching-hash-algo algo`` holds it. ``init_none_hash`` reads PYTHONHASHSEED, like the
    engine does at start-up."""

    def __init__(self, block_size: int, algo: str = "sha256_cbor", num_blocks: int = 256) -> None:
        self.block_size = block_size
        self.hash_fn = get_hash_fn_by_name(algo)
        init_none_hash(self.hash_fn)
        self.block_hasher = get_request_block_hasher(block_size, self.hash_fn)
        self.pool = BlockPool(num_blocks, True, block_size, enable_kv_cache_events=True)

    def request(self, token_ids: list[int], *, cache_salt: str | None = None) -> Request:
        return Request(
            f"req-{next(_ids)}",
            list(token_ids),
            SamplingParams(max_tokens=1),
            None,
            cache_salt=cache_salt,
            block_hasher=self.block_hasher,
        )

    def store(self, token_ids: list[int], *, prefix_blocks: list | None = None, cache_salt: str | None = None):
        """Cache the prompt's full blocks the way the scheduler does after computing them, reusing
        ``prefix_blocks`` (already cached) for its first blocks; returns the request and all its
        blocks (still referenced, so not evictable until ``free``)."""
        req = self.request(token_ids, cache_salt=cache_salt)
        prefix_blocks = list(prefix_blocks or [])
        n_full = len(token_ids) // self.block_size
        blocks = prefix_blocks + self.pool.get_new_blocks(n_full - len(prefix_blocks))
        self.pool.cache_full_blocks(req, blocks, len(prefix_blocks), n_full, self.block_size, 0)
        return req, blocks

    def free(self, blocks: list) -> None:
        self.pool.free_blocks(reversed(blocks))

    def evict_all(self) -> None:
        """Allocate every free block, which evicts every cached one (BlockRemoved events)."""
        self.pool.free_blocks(self.pool.get_new_blocks(self.pool.get_num_free_blocks()))

    def take_events(self) -> list:
        return self.pool.take_events()
