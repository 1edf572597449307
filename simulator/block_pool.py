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

Publishing (``publish_on_compute=True``, as the fleet runs it): vLLM caches a prompt's blocks when it
schedules them, but its KV events leave the engine after the step that computed them, so a router
learns of them a step later. Such a pool keeps newly cached hashes unpublished (out of ``index`` and
``events``) until ``publish()``, which the fleet calls at the end of each of the node's steps; a hash
evicted before then is never published (and so never reported removed). Its own lookups see them at
once, as vLLM's scheduler does.

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
    """``events``: record what vLLM's KV events would say (off for long runs: nothing reads them).
    ``index`` and ``owner``: a fleet-wide map hash -> owners holding it, kept as this pool stores its
    first copy of a hash and evicts its last (the simulator's router lookup reads it)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        events: bool = True,
        index: dict[BlockHash, set[str]] | None = None,
        owner: str = "",
        publish_on_compute: bool = False,
    ) -> None:
        if num_blocks < 2 or block_size <= 0:
            raise ValueError(f"need at least 2 blocks of a positive size (got {num_blocks} x {block_size})")
        self.block_size = block_size
        self.num_blocks = num_blocks
        # per-block state for blocks ever handed out (sparse: a large pool is mostly untouched)
        self._ref: dict[int, int] = {}
        self._hash: dict[int, BlockHash] = {}
        # The free queue (first = next to be reused), in three parts so that an untouched pool costs
        # nothing: blocks put back at the front, then the untouched blocks ``_fresh`` .. num_blocks - 1
        # in id order (vLLM's initial queue; block 0 is the null block, never free), then blocks put
        # back at the end. A block leaves the untouched run once and never returns to it.
        self._front: OrderedDict[int, None] = OrderedDict()
        self._fresh = 1
        self._back: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, list[int]] = {}
        self._requests: dict[str, _Request] = {}
        self._record = events
        self._index = index
        self._owner = owner
        self.events: list[tuple[str, BlockHash]] = []
        """("stored" | "removed", hash), in order, as vLLM's KV events would report them."""
        self._defer = publish_on_compute
        self._unpublished: dict[int, BlockHash] = {}
        """Blocks cached since the last ``publish()`` and their hashes, in caching order."""

    # --- reading --------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._front) + self.num_blocks - self._fresh + len(self._back)

    @property
    def usage(self) -> float:
        """Share of usable blocks held by running requests (vLLM's ``kv_cache_usage``)."""
        return 1.0 - self.free_blocks / (self.num_blocks - 1)

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._cached)

    def free_order(self) -> list[int]:
        return [*self._front, *range(self._fresh, self.num_blocks), *self._back]

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
        ref = self._ref
        evictable = sum(1 for b in hit_blocks if ref[b] == 0)
        if need + evictable > self.free_blocks:
            return None
        for b in hit_blocks:
            if ref[b] == 0:
                self._unfree(b)
            ref[b] += 1
        req = _Request(blocks=hit_blocks + self._take(need), cached=hit)
        self._requests[request_id] = req
        self._cache_full(req, hashes, num_tokens)
        return hit * self.block_size

    def grow(self, request_id: str, hashes: Sequence[BlockHash], num_tokens: int) -> bool:
        """The request now holds ``num_tokens`` tokens (decode); False (no change) when a block is
        needed and none is free. ``hashes``: the full blocks' hashes so far."""
        req = self._requests[request_id]
        need = -(-num_tokens // self.block_size) - len(req.blocks)
        if need > self.free_blocks:
            return False
        if need > 0:
            req.blocks += self._take(need)
        self._cache_full(req, hashes, num_tokens)
        return True

    def free(self, request_id: str) -> None:
        req = self._requests.pop(request_id)
        first: list[int] = []
        ref, back = self._ref, self._back
        for b in reversed(req.blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if b in self._hash:
                    back[b] = None  # back of the queue: evicted last
                else:
                    first.append(b)
        front = self._front
        for b in reversed(first):  # vLLM's prepend_n keeps the list's order at the front
            front[b] = None
            front.move_to_end(b, last=False)

    # --- pieces ---------------------------------------------------------------------------------
    def _unfree(self, b: int) -> None:
        if b in self._front:
            del self._front[b]
        else:
            del self._back[b]

    def _take(self, n: int) -> list[int]:
        out: list[int] = []
        ref, hashes = self._ref, self._hash
        for _ in range(n):
            if self._front:
                b, _ = self._front.popitem(last=False)
            elif self._fresh < self.num_blocks:
                b = self._fresh
                self._fresh += 1
                ref[b] = 0
            else:
                b, _ = self._back.popitem(last=False)
            h = hashes.pop(b, None)
            if h is not None:  # reusing a cached block evicts its hash
                holders = self._cached[h]
                holders.remove(b)
                told = self._unpublished.pop(b, None) is None  # else nobody heard of it: nothing to take back
                if not holders:
                    del self._cached[h]
                    owners = self._index.get(h) if self._index is not None else None
                    if owners is not None:
                        owners.discard(self._owner)
                if self._record and told:
                    self.events.append(("removed", h))
            ref[b] += 1
            out.append(b)
        return out

    def _cache_full(self, req: _Request, hashes: Sequence[BlockHash], num_tokens: int) -> None:
        full = min(num_tokens // self.block_size, len(hashes))
        cached, index, record = self._cached, self._index, self._record
        for i in range(req.cached, full):
            b, h = req.blocks[i], hashes[i]
            self._hash[b] = h
            holders = cached.get(h)
            if holders is None:
                cached[h] = [b]
            else:
                holders.append(b)
            if self._defer:
                self._unpublished[b] = h
                continue
            if index is not None and holders is None:
                self._tell_index(h)
            if record:
                self.events.append(("stored", h))
        req.cached = max(req.cached, full)

    def _tell_index(self, h: BlockHash) -> None:
        assert self._index is not None
        owners = self._index.get(h)
        if owners is None:
            self._index[h] = {self._owner}
        else:
            owners.add(self._owner)

    def publish(self) -> None:
        """What a step's end tells the router: every block cached since the last call that still holds
        its hash, as a stored event and in ``index``."""
        if not self._unpublished:
            return
        for _b, h in self._unpublished.items():
            if self._index is not None:
                self._tell_index(h)
            if self._record:
                self.events.append(("stored", h))
        self._unpublished.clear()
