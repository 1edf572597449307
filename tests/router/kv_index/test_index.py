"""The fleet index, fed with the events vLLM's own BlockPool emits."""

from __future__ import annotations

import random

import pytest

from router.kv_index.block_keys import BlockHasher, BlockKey
from router.kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored
from router.kv_index.index import FleetIndex, ModelIndex, bench_longest_prefix
from tests.support.vllm_helpers import EnginePrefixCache

BS = 16


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49_152) for _ in range(n)]


def _ours(vllm_event) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """vLLM event object -> our wire mirror, through the bytes the publisher sends."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    from router.kv_index.events import decode_batch

    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=[vllm_event]))
    (ev,) = decode_batch(payload).events
    return ev


def _k(*ks: int) -> list[BlockKey]:
    return [BlockKey(k) for k in ks]


def test_engine_events_drive_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    engine = EnginePrefixCache(BS, "sha256_cbor", num_blocks=32)
    hasher = BlockHasher(BS, "sha256_cbor")
    idx = ModelIndex("m", BS)
    prompt = _tokens(10 * BS, seed=1)
    _, blocks = engine.store(prompt[: 6 * BS])
    for ev in engine.take_events():
        idx.apply("p0", _ours(ev))
    # a longer prompt sharing the first 6 blocks: the node matches exactly those 6
    assert idx.longest_prefix(hasher.keys(prompt)) == {"p0": 6}
    assert idx.longest_prefix(hasher.keys(_tokens(4 * BS, seed=2))) == {}

    engine.free(blocks)
    engine.evict_all()
    removed = [_ours(ev) for ev in engine.take_events()]
    assert removed and all(isinstance(ev, BlockRemoved) for ev in removed)
    for ev in removed:
        idx.apply("p0", ev)
    assert idx.longest_prefix(hasher.keys(prompt)) == {}
    assert idx.block_counts() == {"p0": 0}


def test_reset_prefix_cache_clears_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    engine = EnginePrefixCache(BS, "sha256_cbor", num_blocks=32)
    idx = ModelIndex("m", BS)
    prompt = _tokens(4 * BS, seed=3)
    _, blocks = engine.store(prompt)
    engine.free(blocks)
    assert engine.pool.reset_prefix_cache()
    events = [_ours(ev) for ev in engine.take_events()]
    assert isinstance(events[-1], AllBlocksCleared)
    idx.add_blocks("p1", BlockHasher(BS).keys(prompt))
    for ev in events:
        idx.apply("p0", ev)
    assert idx.longest_prefix(BlockHasher(BS).keys(prompt)) == {"p1": 4}


def test_longest_prefix_is_contiguous_per_node() -> None:
    idx = ModelIndex("m", BS)
    idx.add_blocks("a", _k(1, 2, 3, 4))
    idx.add_blocks("b", _k(1, 2, 4))  # lacks block 3: its prefix ends at 2
    idx.add_blocks("c", _k(2, 3, 4))  # lacks block 1: no prefix at all
    assert idx.longest_prefix(_k(1, 2, 3, 4, 5)) == {"a": 4, "b": 2}
    assert idx.longest_prefix(_k(1)) == {"a": 1, "b": 1}
    assert idx.longest_prefix([]) == {}


def test_duplicate_copies_are_reference_counted() -> None:
    idx = ModelIndex("m", BS)
    stored = BlockStored(block_hashes=[7, 8], token_ids=[0] * 32, block_size=BS, medium="GPU")
    idx.apply("a", stored)
    idx.apply("a", stored)  # same prefix computed twice at once: two engine blocks
    idx.apply("a", BlockRemoved(block_hashes=[7, 8], medium="GPU"))
    assert idx.longest_prefix(_k(7, 8)) == {"a": 2}
    idx.apply("a", BlockRemoved(block_hashes=[7, 8], medium="GPU"))
    assert idx.longest_prefix(_k(7, 8)) == {}
    idx.apply("a", BlockRemoved(block_hashes=[7], medium="GPU"))  # unknown: ignored
    assert len(idx) == 0


def test_foreign_events_are_ignored() -> None:
    idx = ModelIndex("m", BS)
    idx.apply("a", BlockStored(block_hashes=[1], token_ids=[0] * 16, block_size=BS, medium="CPU"))
    idx.apply("a", BlockStored(block_hashes=[1], token_ids=[0] * 32, block_size=32, medium="GPU"))
    idx.apply("a", BlockStored(block_hashes=[1], token_ids=[0] * 16, block_size=BS, group_idx=1))
    assert idx.ignored_events == 3
    assert idx.longest_prefix(_k(1)) == {}
    idx.apply("a", BlockStored(block_hashes=[1], token_ids=[0] * 16, block_size=BS, medium="GPU"))
    idx.apply("a", BlockRemoved(block_hashes=[1], medium="CPU"))  # another tier's copy left
    assert idx.longest_prefix(_k(1)) == {"a": 1}


def test_drop_node_frees_its_slot_for_the_next_node() -> None:
    fleet = FleetIndex()
    m = fleet.model("m", BS)
    m.add_blocks("a", _k(1, 2))
    m.add_blocks("b", _k(1))
    fleet.drop_node("a")
    assert fleet.longest_prefix("m", _k(1, 2)) == {"b": 1}
    m.add_blocks("c", _k(1, 2))  # takes a's bit; must not inherit a's blocks
    assert fleet.longest_prefix("m", _k(1, 2)) == {"b": 1, "c": 2}
    assert fleet.block_counts() == {"m": {"b": 1, "c": 2}}
    assert fleet.longest_prefix("other", _k(1)) == {}


def test_clear_node_keeps_other_nodes() -> None:
    m = ModelIndex("m", BS)
    m.add_blocks("a", _k(1, 2, 2))
    m.add_blocks("b", _k(1, 2))
    m.clear_node("a")
    assert m.longest_prefix(_k(1, 2)) == {"b": 2}
    assert m.block_counts() == {"a": 0, "b": 2}


def test_bench_function_runs() -> None:
    us = bench_longest_prefix(num_nodes=2, num_keys=64, cached_per_node=100, repeat=10)
    assert 0 < us < 10_000


def _tier_stored(*ks: int) -> BlockStored:
    return BlockStored(block_hashes=list(ks), block_size=BS, medium="CPU_SHM")


def test_a_node_s_match_goes_on_into_its_host_tier_as_its_connector_looks_it_up() -> None:
    fleet = FleetIndex()
    idx = fleet.model("m", BS)
    idx.apply("n0", BlockStored(block_hashes=[1, 2], block_size=BS, medium="GPU"))
    fleet.set_tiers({("m", BS): {"n0": "tier@h", "n1": "tier@h"}})
    idx.apply("tier@h", _tier_stored(2, 3, 4, 6))
    keys = _k(1, 2, 3, 4, 5, 6)
    # n0: its own 1, 2, then the tier's 3, 4 (from the first block it lacks), stopping at 5;
    # n1 holds nothing itself, and the tier lacks block 1: no reuse; the tier holds no prefix either.
    assert fleet.longest_prefix("m", keys) == {"n0": 4}
    assert fleet.split("m", keys, "n0") == (2, 2)
    idx.apply("tier@h", _tier_stored(1))
    assert fleet.longest_prefix("m", keys) == {"n0": 4, "n1": 4, "tier@h": 4}
    assert fleet.split("m", keys, "n1") == (0, 4)


def test_tier_events_count_only_for_tiers_and_engine_events_only_for_engines() -> None:
    fleet = FleetIndex()
    idx = fleet.model("m", BS)
    fleet.set_tiers({("m", BS): {"n0": "tier@h"}})
    idx.apply("n0", _tier_stored(1))  # an engine never holds a CPU_SHM block of its own
    idx.apply("tier@h", BlockStored(block_hashes=[1], block_size=BS, medium="GPU"))
    assert fleet.longest_prefix("m", _k(1)) == {} and idx.ignored_events == 2
    idx.apply("tier@h", _tier_stored(1))
    idx.apply("tier@h", BlockRemoved(block_hashes=[1], medium="CPU_SHM"))
    assert fleet.longest_prefix("m", _k(1)) == {}
    assert idx.evicted[BlockKey(1)].cause == "CPU_SHM"  # miss attribution names the tier it left


def test_detached_nodes_lose_their_tier_s_blocks() -> None:
    fleet = FleetIndex()
    idx = fleet.model("m", BS)
    fleet.set_tiers({("m", BS): {"n0": "tier@h"}})
    idx.apply("tier@h", _tier_stored(1, 2))
    assert fleet.longest_prefix("m", _k(1, 2))["n0"] == 2
    fleet.set_tiers({})  # n0 left the registry
    assert "n0" not in fleet.longest_prefix("m", _k(1, 2))
