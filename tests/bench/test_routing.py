"""bench.routing's arithmetic: engine-confirmed hit rate, prefill tokens, ideal_hit in send order,
and the issue's targets."""

from __future__ import annotations

import math

from bench.loadgen import RequestResult, SentRequest
from bench.routing import _summarize, _targets


def _sent(session: str, turn: int, sent_s: float, prompt: int, cached: int, ttft_s: float) -> SentRequest:
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": cached},
        "tandem": {"mode": "disaggregated", "routed_cached_tokens": cached, "engine_cached_tokens": cached},
    }
    return SentRequest(
        session,
        turn,
        sent_s,
        0.0,
        RequestResult(ok=True, ttft_s=ttft_s, e2e_s=ttft_s + 1, prompt_tokens=prompt, usage=usage),
    )


def test_summary_counts_engine_reuse_and_ideal_in_send_order() -> None:
    a0, a1, b0 = list(range(40)), list(range(40)) + [99] * 20, list(range(36)) + [7] * 4
    ids = {("a", 0): a0, ("a", 1): a1, ("b", 0): b0}
    sent = [_sent("a", 0, 0.0, 40, 0, 0.5), _sent("b", 0, 0.5, 40, 32, 0.1), _sent("a", 1, 1.0, 60, 32, 0.2)]
    s = _summarize(sent, ids, block_size=16, wall_s=3.0)
    assert (s["requests"], s["errors"], s["prompt_tokens"], s["cached_tokens"]) == (3, 0, 140, 64)
    assert s["prefill_tokens"] == 76 and math.isclose(s["hit"], 64 / 140)
    # Unlimited cache, in send order: b0 reuses a0's first 2 blocks, a1 a0's 2 (its 3rd block differs).
    assert math.isclose(s["ideal_hit"], 64 / 140)
    assert s["ttft_p50_ms"] == 200 and s["prompt_token_mismatches"] == 0 and s["routed_equals_engine"] == 1.0


def test_targets_follow_the_issue() -> None:
    s = {
        "cache_hit": 0.80,
        "ideal_hit": 0.84,
        "rr_hit": 0.70,
        "cache_ttft_p50_ms": 900.0,
        "rr_ttft_p50_ms": 1200.0,
        "colo_cache_hit": 0.78,
        "peer_hit": 0.79,
    }
    t = _targets(s)
    assert t["cache_hit >= 0.95 * ideal_hit"]["held"]  # 0.80 >= 0.798
    assert t["1 - cache_hit <= 0.75 * (1 - rr_hit)"]["held"]  # 0.20 <= 0.225
    assert t["cache_ttft_p50_ms < rr_ttft_p50_ms"]["held"]
    assert not t["colo_cache_hit >= peer_hit"]["held"]
    assert "colo_cache_hit >= peer_hit" not in _targets({**s, "peer_hit": math.nan})  # part 3 skipped
