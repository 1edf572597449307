"""The simulator's block pool against vLLM's own ``KVCacheManager`` (the installed vllm, prefix caching
on, one full-attention group): the same requests, admitted, decoded and freed in the same order, give
the same reused tokens, the same refusals when the pool is full, the same cached hashes and the same
eviction order, block id for block id."""

from __future__ import annotations

import random

import pytest

vllm = pytest.importorskip("vllm", reason="the reference is the installed vLLM")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from simulator.block_pool import SimBlockPool  # noqa: E402

BS = 16


def _manager(num_blocks: int) -> KVCacheManager:
    init_none_hash(sha256_cbor)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS, enable_caching=True)


def _vllm_cached(m: KVCacheManager) -> set[bytes]:
    return {bytes(k)[:-4] for k in m.block_pool.cached_block_hash_to_block._cache}  # key = hash + group id


def _vllm_free(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_hits_refusals_cached_hashes_and_eviction_order_as_vllm(seed):
    rng = random.Random(seed)
    num_blocks = 24
    m, sim = _manager(num_blocks), SimBlockPool(num_blocks, BS)
    hasher = get_request_block_hasher(BS, sha256_cbor)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([20, 40, 64, 100]))] for _ in range(4)]
    running: dict[str, Request] = {}
    hits = refusals = 0
    for step in range(160):
        if running and (rng.random() < 0.4 or len(running) > 6):
            rid = rng.choice(sorted(running))
            r = running[rid]
            if rng.random() < 0.5:  # decode a few tokens, then maybe finish
                for _ in range(rng.randrange(1, 20)):
                    r.append_output_token_ids(rng.randrange(1000))  # the token the last step made
                    ok = m.allocate_slots(r, r.num_tokens - r.num_computed_tokens) is not None
                    assert sim.grow(rid, r.block_hashes, r.num_tokens) == ok
                    if not ok:
                        break
                    r.num_computed_tokens = r.num_tokens
                continue
            m.free(r)
            sim.free(rid)
            del running[rid]
        else:
            rid = f"r{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 60))]
            r = Request(rid, tokens, SamplingParams(max_tokens=64), None, block_hasher=hasher)
            blocks, n_hit, _ = m.get_computed_blocks(r)
            assert sim.lookup(r.block_hashes, r.num_tokens) * BS == n_hit
            got = m.allocate_slots(r, r.num_tokens - n_hit, n_hit, blocks)
            admitted = sim.admit(rid, r.block_hashes, r.num_tokens)
            assert (got is None) == (admitted is None)
            if got is None:
                refusals += 1
                continue
            assert admitted == n_hit
            hits += n_hit > 0
            r.num_computed_tokens = r.num_tokens
            running[rid] = r
        assert sim.cached_hashes() == _vllm_cached(m), f"step {step}"
        assert sim.free_order() == _vllm_free(m), f"step {step}"
    # the sequence exercised what it is about: reuse and a full pool
    assert hits > 10 and refusals > 0


def test_a_deferred_pool_tells_the_index_only_at_publish_and_never_of_what_it_evicted_before():
    index: dict = {}
    pool = SimBlockPool(4, 2, events=True, index=index, owner="n", publish_on_compute=True)
    assert pool.admit("a", ["h1", "h2"], 4) == 0
    assert pool.lookup(["h1", "h2"], 5) == 2  # the engine's own scheduler sees them at once
    assert index == {} and pool.events == []  # the router does not, until the step that computed them ends
    pool.publish()
    assert index == {"h1": {"n"}, "h2": {"n"}} and pool.events == [("stored", "h1"), ("stored", "h2")]
    pool.events.clear()
    pool.free("a")
    assert pool.admit("b", ["h3"], 2) == 0  # takes the free block 3, still unpublished
    pool.free("b")
    assert pool.admit("c", ["x1", "x2", "x3"], 6) == 0  # evicts h1, h2 (told: removed) and h3 (never told)
    assert ("removed", "h3") not in pool.events
    assert {h for kind, h in pool.events if kind == "removed"} == {"h1", "h2"}
    assert "n" not in index.get("h1", set()) and "h3" not in index
