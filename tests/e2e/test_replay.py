"""``tandem replay`` against the real cluster (vLLM engines, P/D and colocated): a small synthetic
agentic trace, closed loop. Real engines honour ``ignore_eos`` (exactly the trace's output lengths),
count the prompt ids the replay sent, and report prefix-cache hits that the trace's structure makes
possible: some, and never more than the infinite-cache ceiling."""

from __future__ import annotations

import asyncio

import pytest

from replay import Mode, ReplaySettings, plan, run, summarize, to_table
from tests.e2e.conftest import LiveCluster
from traces.synth import AgenticSpec, synth_agentic

pytestmark = pytest.mark.e2e

SPEC = AgenticSpec(
    sessions=2,
    seed=11,
    session_rate=5.0,
    system_prompts=1,
    system_tokens=256,
    repositories=1,
    repo_tokens=(256, 256),
    user_tokens=(16, 32),
    turns_mean=3.0,
    output_tokens=(4, 8),
    tool_tokens_median=64.0,
    gap_s_median=0.1,
    max_input_tokens=1500,
)


def test_closed_loop_replay_on_real_engines(cluster: LiveCluster) -> None:
    trace = synth_agentic(SPEC)
    planned, scaling = plan(trace, block_size=16, context_window=8192)
    assert scaling.unit_tokens == 16
    settings = ReplaySettings(url=cluster.url, model=cluster.model, mode=Mode.CLOSED, session_prefix="replay-e2e-")
    table = to_table(asyncio.run(run(planned, settings)))
    rows = table.to_pylist()
    assert len(rows) == len(trace) >= 3
    for r in rows:
        assert r["status"] == "ok", r["error"]
        assert r["prompt_tokens"] == r["prompt_tokens_sent"]
        assert r["completion_tokens"] == r["max_tokens"]
        assert r["ttft_s"] > 0 and r["cached_tokens"] <= r["ceiling_tokens"]
    s = summarize(table)
    # the shared system prompt and repository and the growing turns: the engines reuse some of it
    assert 0 < s.observed_hit <= s.ceiling_hit
