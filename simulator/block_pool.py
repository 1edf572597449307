"""SIMULATOR: one node's KV cache, block for block as vLLM's (0.32) ``KVCacheManager`` with prefix
caching counts it, without the engine. Labelled a simulation everywhere it is used.

What is reproduced (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``,
``single_type_kv_cache_manager.py``; ``tests/simulator/test_block_pool.py`` drives both with the same
requests and compares):

- ``num_blocks`` blocks of ``block_size`` tokens; block 0 is vLLM's null block, never handed out.
- Lookup: the longest run of leading block hashes that are cached, at most ``(tokens - 1) // bs``
  blocks (vLLM recomputes the last prompt token, so a whole-prompt match reuses one block less).
- Admission (``allocate_slots``): the request needs ``ceil(tokens / bs)`` blocks; the hit blocks
  it takes from the free queue (ref count 0, evictable) count against the free blocks too; if they
  do not fit, nothing changes (the engine would keep the request waiting). Else hit blocks are
  touched (ref + 1, out of the free queue), new blocks are taken from the front of the free queue
  (evicting the hash each one carried) and every full block of the prompt is cached under its hash.
- Decode: each ``grow`` to a longer length takes blocks as needed and caches those that fill (their
  hashes are the caller's: vLLM's hash the generated tokens).
- Finish (``free``): the request's blocks in reverse order, ref - 1; a block reaching 0 goes to the
  *back* of the free queue if it is cached (LRU: the tail of a chain is evicted first) and to the
  *front* if it is not (reused first).
- A hash may be cached on several blocks (two requests filled the same block before either was
  cached); a lookup takes the first.

What is not: chunked prefill's partial progress (a prompt's blocks are cached at admission, as vLLM
does when the whole prompt is scheduled in one step), preemption, the watermark, sliding window and
hybrid models, multimodal or LoRA extra keys. ``events`` records what vLLM's KV events would say
(stored and removed hashes), for a router index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

BlockHash = Hashable


@dataclass
class _Request:
    blocks: list[int] = field(default_factory=list)
    cached: int = 0
    """Leading blocks of ``blocks`` that are cached (carry a hash)."""


class SimBlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2 or block_size <= 0:
            raise ValueError(f"need at least 2 blocks of a positive size (got {num_blocks} x {block_size})")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        # eviction order: first = next to be reused; block 0 is the null block, never free
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._cached: dict[BlockHash, list[int]] = {}
        self._requests: dict[str, _Request] = {}
        self.events: list[tuple[str, BlockHash]] = []
        """("stored" | "removed", hash), in order, as vLLM's KV events would report them."""

    # --- reading --------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of usable blocks held by running requests (vLLM's ``kv_cache_usage``)."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._cached)

    def free_order(self) -> list[int]:
        return list(self._free)

    def lookup(self, hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """Leading blocks of a prompt of ``num_tokens`` tokens that would be reused now."""
        cap = min(len(hashes), max(num_tokens - 1, 0) // self.block_size)
        n = 0
        while n < cap and hashes[n] in self._cached:
            n += 1
        return n

    # --- a request's life -----------------------------------------------------------------------
    def admit(self, request_id: str, hashes: Sequence[BlockHash], num_tokens: int) -> int | None:
        """Allocate a prompt's blocks; the reused tokens, or None (and no change) when it does not fit.
        ``hashes``: the hashes of the prompt's full blocks (at least ``num_tokens // block_size``)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already admitted")
        hit = self.lookup(hashes, num_tokens)
        hit_blocks = [self._cached[h][0] for h in hashes[:hit]]
        need = -(-num_tokens // self.block_size) - hit
        evictable = sum(1 for b in hit_blocks if self._ref[b] == 0)
        if need + evictable > len(self._free):
            return None
        for b in hit_blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        req = _Request(blocks=hit_blocks + self._take(need), cached=hit)
        self._requests[request_id] = req
        self._cache_full(req, hashes, num_tokens)
        return hit * self.block_size

    def grow(self, request_id: str, hashes: Sequence[BlockHash], num_tokens: int) -> bool:
        """The request now holds ``num_tokens`` tokens (decode); False (no change) when a block is
        needed and none is free. ``hashes``: the full blocks' hashes so far."""
        req = self._requests[request_id]
        need = -(-num_tokens // self.block_size) - len(req.blocks)
        if need > len(self._free):
            return False
        if need > 0:
            req.blocks += self._take(need)
        self._cache_full(req, hashes, num_tokens)
        return True

    def free(self, request_id: str) -> None:
        req = self._requests.pop(request_id)
        first: list[int] = []
        for b in reversed(req.blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    first.append(b)
                else:
                    self._free[b] = None  # back of the queue: evicted last
        for b in reversed(first):  # vLLM's prepend_n keeps the list's order at the front
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    # --- pieces ---------------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:  # reusing a cached block evicts its hash
                holders = self._cached[h]
                holders.remove(b)
                if not holders:
                    del self._cached[h]
                self._hash[b] = None
                self.events.append(("removed", h))
            self._ref[b] += 1
            out.append(b)
        return out

    def _cache_full(self, req: _Request, hashes: Sequence[BlockHash], num_tokens: int) -> None:
        full = min(num_tokens // self.block_size, len(hashes))
        for i in range(req.cached, full):
            b, h = req.blocks[i], hashes[i]
            self._hash[b] = h
            self._cached.setdefault(h, []).append(b)
            self.events.append(("stored", h))
        req.cached = max(req.cached, full)
