from __future__ import annotations

import pytest

from router.kv_index.ideal import ideal_cached_tokens, ideal_hit_rate

BS = 4


def test_growing_chat_hits_its_history() -> None:
    system = list(range(100, 108))  # 2 blocks
    t1 = system + [1, 2, 3, 4, 5]  # 13 tokens, 3 full blocks
    t2 = t1 + [6, 7, 8, 9, 10, 11]  # 19 tokens: shares t1's 3 full blocks
    other = system + [50, 51, 52, 53, 54]  # shares the system prompt only
    assert ideal_cached_tokens([t1, t2, other], BS) == [0, 12, 8]
    assert ideal_hit_rate([t1, t2, other], BS) == pytest.approx(20 / (13 + 19 + 13))


def test_same_block_at_another_position_is_not_a_hit() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 0]
    b = [9, 9, 9, 9, 5, 6, 7, 8, 0]  # block 2 equal, block 1 not: prefix chain broken
    assert ideal_cached_tokens([a, b], BS) == [0, 0]


def test_last_token_is_never_reused() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    assert ideal_cached_tokens([a, a], BS) == [0, 4]  # vLLM recomputes the last token: 1 block less
    assert ideal_hit_rate([], BS) == 0.0
    with pytest.raises(ValueError):
        ideal_cached_tokens([a], 0)
