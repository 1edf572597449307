"""Our routing keys against vLLM 0.32's own hashing code and the events its BlockPool emits."""

from __future__ import annotations

import random

import pytest

from contracts.errors import ConfigError
from router.kv_index.block_keys import BlockHasher, block_keys, external_key
from tests.support.vllm_helpers import EnginePrefixCache

BS = 16


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49_152) for _ in range(n)]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_keys_equal_vllm_request_block_hashes(monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    engine = EnginePrefixCache(BS, algo)
    tokens = _tokens(8 * BS + 5)
    req = engine.request(tokens)
    hasher = BlockHasher(BS, algo)
    assert len(req.block_hashes) == 8  # only full blocks
    assert hasher.block_hashes(tokens) == list(req.block_hashes)
    assert hasher.keys(tokens) == [external_key(h) for h in req.block_hashes]


def test_seed_from_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "4242")
    engine = EnginePrefixCache(BS, "sha256_cbor")
    tokens = _tokens(4 * BS, seed=1)
    engine_keys = [external_key(h) for h in engine.request(tokens).block_hashes]
    assert BlockHasher(BS, "sha256_cbor", seed="4242").keys(tokens) == engine_keys
    assert BlockHasher(BS, "sha256_cbor").keys(tokens) != engine_keys  # default seed: mismatch


def test_keys_equal_block_stored_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's published keys (BlockStored from vLLM's BlockPool) for a growing multi-turn chat."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    engine = EnginePrefixCache(BS, "sha256_cbor")
    hasher = BlockHasher(BS, "sha256_cbor")
    turn1 = _tokens(5 * BS + 3, seed=2)
    _, blocks1 = engine.store(turn1)
    (ev1,) = engine.take_events()
    assert ev1.parent_block_hash is None
    assert ev1.block_hashes == hasher.keys(turn1)
    assert ev1.token_ids == turn1[: 5 * BS]

    turn2 = turn1 + _tokens(3 * BS + 7, seed=3)  # history grows: earlier turn + tool output
    _, blocks2 = engine.store(turn2, prefix_blocks=blocks1[:5])
    (ev2,) = engine.take_events()
    keys2 = hasher.keys(turn2)
    assert ev2.parent_block_hash == keys2[4]
    assert ev2.block_hashes == keys2[5:]
    assert keys2[:5] == ev1.block_hashes


def test_cache_salt_changes_first_block_like_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    engine = EnginePrefixCache(BS, "sha256_cbor")
    tokens = _tokens(3 * BS, seed=4)
    salted = engine.request(tokens, cache_salt="tenant-a")
    ours = block_keys(tokens, BS, cache_salt="tenant-a")
    assert ours == [external_key(h) for h in salted.block_hashes]
    assert ours[0] != block_keys(tokens, BS)[0]


def test_external_key_maps_bytes_and_ints_alike() -> None:
    h = bytes(range(32))
    assert external_key(h) == int.from_bytes(h[-8:], "big")
    assert external_key(int.from_bytes(h, "big")) == external_key(h)


def test_memo_does_not_change_keys() -> None:
    hasher = BlockHasher(BS, "sha256_cbor", memo_blocks=3)
    tokens = _tokens(10 * BS, seed=5)
    first = hasher.keys(tokens)
    assert hasher.keys(tokens) == first  # served from the memo (cleared when full)
    assert BlockHasher(BS, "sha256_cbor").keys(tokens) == first
    assert hasher.keys(tokens[: BS - 1]) == []


def test_first_block_check() -> None:
    hasher = BlockHasher(BS, "sha256_cbor")
    tokens = _tokens(2 * BS, seed=6)
    k = hasher.keys(tokens)
    assert hasher.first_block_matches(tokens, k[0])
    assert not hasher.first_block_matches(tokens, k[1])
    assert not BlockHasher(BS, "sha256").first_block_matches(tokens, k[0])


def test_bad_config() -> None:
    with pytest.raises(ConfigError):
        BlockHasher(BS, "md5")
    with pytest.raises(ConfigError):
        BlockHasher(BS, "xxhash_cbor")  # random per-process seed in vLLM without PYTHONHASHSEED
    with pytest.raises(ConfigError):
        BlockHasher(0)
