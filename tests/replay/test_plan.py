"""The replay plan: rescaling to the context window, prompts whose shared prefixes are the trace's,
and the ceiling of the prompts as sent."""

from __future__ import annotations

import pytest

from replay.plan import choose_unit, plan
from traces import TraceError, TraceMeta, make_trace
from traces.hashing import chain_ids

COLS = ("session_id", "parent_request_id", "turn", "gap_s", "cached_tokens", "cancel_after_s")


def _trace(rows: list[tuple[int, int, list[int]]], base: int = 512):
    cols: dict[str, list[object]] = {c: [None] * len(rows) for c in COLS}
    cols["turn"] = [0] * len(rows)
    cols["request_id"] = [f"r{i}" for i in range(len(rows))]
    cols["arrival_s"] = [float(i) for i in range(len(rows))]
    cols["input_tokens"] = [r[0] for r in rows]
    cols["output_tokens"] = [r[1] for r in rows]
    cols["block_hashes"] = [chain_ids(r[2]) for r in rows]
    return make_trace(cols, TraceMeta(base, "test"))


def test_lengths_as_recorded_when_they_fit():
    t = _trace([(1100, 10, [0, 1, 2]), (1600, 20, [0, 1, 5, 6])])
    reqs, scaling = plan(t, block_size=16, context_window=4096)
    assert scaling.unit_tokens == 16 and scaling.truncated == 0
    assert [len(r.prompt) for r in reqs] == [1100, 1600] and [r.max_tokens for r in reqs] == [10, 20]
    # base blocks 0 and 1 are shared: the first 1,024 tokens are equal, the next are not
    assert reqs[0].prompt[:1024] == reqs[1].prompt[:1024] and reqs[0].prompt[1024:1040] != reqs[1].prompt[1024:1040]
    assert [r.ceiling_tokens for r in reqs] == [0, 1024]
    assert "as recorded" in scaling.describe()


def test_scaled_to_the_context_window_keeps_the_shared_structure():
    t = _trace([(6000, 600, list(range(12))), (6100, 100, [*range(10), 50, 51])])
    assert choose_unit(t, 16, 2048) == 64  # 6000 / 64 * 16 + 600 / 4 = 1650 fits; at 32 it would not
    reqs, scaling = plan(t, block_size=16, context_window=2048)
    assert scaling.factor == 0.25 and scaling.truncated == 0
    assert [len(r.prompt) for r in reqs] == [1500, 1525] and [r.max_tokens for r in reqs] == [150, 25]
    # 10 shared base blocks of 512 = 80 units of 64 = 80 sent blocks of 16 = 1,280 shared tokens
    assert reqs[0].prompt[:1280] == reqs[1].prompt[:1280] and reqs[0].prompt[1280:1296] != reqs[1].prompt[1280:1296]
    assert reqs[1].ceiling_tokens == 1280
    assert all(len(r.prompt) + r.max_tokens <= 2048 for r in reqs)
    assert "scaled by 0.25" in scaling.describe()


def test_a_given_unit_that_does_not_fit_cuts_prompts_and_says_so():
    t = _trace([(6000, 100, list(range(12)))])
    reqs, scaling = plan(t, block_size=16, context_window=1024, unit_tokens=32)
    assert scaling.truncated == 1 and len(reqs[0].prompt) + reqs[0].max_tokens <= 1024
    assert "1 prompts cut" in scaling.describe()


def test_bad_units_are_refused():
    t = _trace([(600, 10, [1, 2])])
    with pytest.raises(TraceError, match="multiple or divisor"):
        plan(t, block_size=16, context_window=4096, unit_tokens=48)
    with pytest.raises(TraceError, match="at least the block size"):
        plan(t, block_size=16, context_window=4096, unit_tokens=8)
