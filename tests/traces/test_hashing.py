"""Chained block hashes: prefix semantics, regrouping into coarser and finer blocks, replay tokens."""

from __future__ import annotations

import pytest

from traces.hashing import TraceError, block_token_ids, chain_ids, chain_segments, regroup


def test_chained_hash_names_the_whole_prefix():
    a, b = chain_ids([7, 8, 9]), chain_ids([7, 8, 10])
    c = chain_ids([1, 8, 9])
    assert a[:2] == b[:2] and a[2] != b[2]
    # the same block id after a different prefix is a different block
    assert not set(a) & set(c)


def test_segments_share_exactly_the_blocks_filled_whole():
    short = chain_segments([("sys", 40), ("u", 10)], 16)  # 50 tokens: 3 full blocks + partial of 2
    longer = chain_segments([("sys", 40), ("u", 10), ("answer", 30)], 16)  # 80 tokens: 5 full
    assert len(short) == 4 and len(longer) == 5
    assert short[:3] == longer[:3]
    assert short[3] != longer[3]  # the partial block is not the fuller one at the same place
    other = chain_segments([("sys", 40), ("v", 10)], 16)
    assert other[:2] == short[:2] and other[2] != short[2]  # block 2 holds tokens 32..48: sys and u


def test_regroup_to_a_multiple_keeps_the_last_base_hash_of_each_group():
    h = chain_ids(range(10))  # 10 base blocks of 16 tokens, 155 tokens (last partial)
    assert regroup(h, 155, 16, 64) == [h[3], h[7]]
    assert regroup(h, 155, 16, 16) == h[:9]


def test_regroup_to_a_divisor_shares_sub_blocks_of_shared_base_blocks_only():
    a, b = chain_ids([1, 2, 3]), chain_ids([1, 2, 4])
    fa, fb = regroup(a, 1536, 512, 16), regroup(b, 1536, 512, 16)
    assert len(fa) == 96 and len(set(fa)) == 96
    assert fa[:64] == fb[:64] and not set(fa[64:]) & set(fb)
    # a partial last base block contributes only the fine blocks it fills whole
    assert len(regroup(a, 1024 + 40, 512, 16)) == 64 + 2


def test_regroup_refuses_block_sizes_whose_boundaries_cannot_be_placed():
    with pytest.raises(TraceError, match="neither a multiple nor a divisor"):
        regroup(chain_ids([1]), 512, 512, 48)


def test_block_tokens_are_a_function_of_the_hash_and_prefix_stable():
    a = block_token_ids(12345, 64, (100, 1000))
    assert a.tolist() == block_token_ids(12345, 64, (100, 1000)).tolist()
    assert block_token_ids(12345, 20, (100, 1000)).tolist() == a[:20].tolist()
    assert a.min() >= 100 and a.max() < 1000
    assert a.tolist() != block_token_ids(12346, 64, (100, 1000)).tolist()
