"""``tandem replay`` over real HTTP and SSE against a real router (``tandem``'s ASGI app under uvicorn,
real Redis registry and admission) in front of STAND-IN engines (``bench.standin_engine``: no model,
fixed replies; usage counts the prompt's ids). What is tested is the replay: what it sends, when, and
what it records; serving itself is tested against real engines elsewhere."""

from __future__ import annotations

import asyncio

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import tests.support.standin_cluster as standin
from contracts.registry import Role
from replay import Mode, ReplaySettings, plan, run, summarize, to_table
from tandem.cli import app
from tests.support.helpers import wait_for
from tests.support.standin_cluster import standin_cluster
from traces import TraceMeta, make_trace, write_trace
from traces.hashing import chain_ids
from traces.synth import AgenticSpec, synth_agentic

SPEC = AgenticSpec(
    sessions=3,
    seed=7,
    session_rate=20.0,
    system_prompts=1,
    system_tokens=64,
    repositories=2,
    repo_tokens=(32, 64),
    user_tokens=(8, 16),
    turns_mean=3.0,
    output_tokens=(4, 8),
    tool_tokens_median=20.0,
    gap_s_median=0.05,
)


@pytest.fixture(autouse=True)
def _redis_db(monkeypatch):
    """This suite's Redis database (13); the stand-in cluster reads the module's URL when it runs."""
    monkeypatch.setattr(standin, "REDIS_URL", "redis://127.0.0.1:6379/13")


def _by_id(table):
    return {r["request_id"]: r for r in table.to_pylist()}


async def test_closed_loop_replay_sends_the_planned_prompts_after_each_answer_and_gap(tmp_path):
    trace = synth_agentic(SPEC)
    async with standin_cluster(tmp_path, {"n": Role.BOTH}) as c:
        planned, scaling = plan(trace, block_size=16, context_window=4096)
        assert scaling.unit_tokens == 16  # short prompts: sent as recorded
        settings = ReplaySettings(url=c.url, model=c.model, mode=Mode.CLOSED, speed=1.0)
        table = to_table(await run(planned, settings))
        received = c.engines["n"].bodies("/v1/completions")
    rows = _by_id(table)
    trace_rows = _by_id(trace.table)
    assert set(rows) == set(trace_rows) and table.num_rows == len(trace) > 3
    for p in planned:
        r = rows[p.request_id]
        assert r["status"] == "ok", r["error"]
        # the stand-in counts the prompt's ids: what arrived is what was planned
        assert r["prompt_tokens"] == r["prompt_tokens_sent"] == trace_rows[p.request_id]["input_tokens"]
        assert r["completion_tokens"] == 2 and r["cached_tokens"] == 0  # the stand-in's fixed reply, no cache
        assert r["ttft_s"] is not None and 0 <= r["ttft_s"] <= r["end_s"] - r["sent_s"]
        assert r["max_tokens"] == trace_rows[p.request_id]["output_tokens"]
        if p.parent_index is not None:
            parent = rows[planned[p.parent_index].request_id]
            # closed loop: not before the parent's answer ended plus the recorded gap
            assert r["sent_s"] >= parent["end_s"] + p.gap_s - 1e-3
            assert r["ceiling_tokens"] >= (parent["prompt_tokens_sent"] // 16) * 16
    prompts = sorted(tuple(b["prompt"]) for b in received)
    assert prompts == sorted(tuple(p.prompt) for p in planned)
    assert all(b["stream"] and b["ignore_eos"] and b["stream_options"]["include_usage"] for b in received)
    s = summarize(table)
    assert s.ok == len(trace) and s.observed_hit == 0 and s.ceiling_hit > 0.3


async def test_open_loop_sends_at_the_timestamps_and_a_recorded_cancel_closes_the_stream(tmp_path):
    cols = {
        "request_id": ["a", "b", "c"],
        "session_id": [None] * 3,
        "parent_request_id": [None] * 3,
        "turn": [0] * 3,
        "arrival_s": [0.0, 0.2, 0.4],
        "gap_s": [None] * 3,
        "input_tokens": [40, 40, 40],
        "output_tokens": [3, 3, 3],
        "block_hashes": [chain_ids([i, 0, 0]) for i in range(3)],
        "cached_tokens": [None] * 3,
        "cancel_after_s": [None, 0.3, None],
    }
    trace = make_trace(cols, TraceMeta(16, "test"))
    async with standin_cluster(tmp_path, {"n": Role.BOTH}) as c:
        engine = c.engines["n"]
        planned, _ = plan(trace, block_size=16, context_window=4096)
        engine.close_gate()  # answers wait: open loop must not
        b_ended = asyncio.Event()

        def on_result(r):
            if r.planned.request_id == "b":
                b_ended.set()

        settings = ReplaySettings(url=c.url, model=c.model, speed=2.0)
        task = asyncio.create_task(run(planned, settings, on_result))
        await asyncio.wait_for(b_ended.wait(), 10)  # b's client leaves 0.15 s (0.3 / speed 2) after sending
        engine.open_gate()
        table = to_table(await task)
        assert len(engine.bodies("/v1/completions")) == 3
    rows = _by_id(table)
    for rid, at in (("a", 0.0), ("b", 0.1), ("c", 0.2)):
        assert at <= rows[rid]["sent_s"] < at + 0.1
    assert rows["a"]["status"] == rows["c"]["status"] == "ok"
    assert rows["b"]["status"] == "cancelled" and rows["b"]["ttft_s"] is None
    assert rows["b"]["end_s"] - rows["b"]["sent_s"] == pytest.approx(0.15, abs=0.05)
    # a and c were answered only after the gate opened, after c was sent: open loop did not wait
    assert rows["a"]["end_s"] > rows["c"]["sent_s"]


async def test_cli_replays_and_writes_results(tmp_path):
    trace_file = tmp_path / "t.parquet"
    write_trace(synth_agentic(SPEC), trace_file)
    out = tmp_path / "res.parquet"
    async with standin_cluster(tmp_path, {"n": Role.BOTH}) as c:
        args = ["replay", str(trace_file), "--url", c.url, "--mode", "closed", "--out", str(out), "--limit", "4"]
        result = await asyncio.to_thread(CliRunner().invoke, app, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "lengths as recorded (context window 4096)" in text
    assert "ok 4" in text and "trace ceiling" in text and "observed 0.0%" in text
    table = pq.read_table(out)
    assert table.num_rows == 4 and set(table.column("status").to_pylist()) == {"ok"}
    assert table.schema.metadata[b"tandem.replay.mode"] == b"closed"


async def test_cli_against_nothing_says_so(tmp_path):
    trace_file = tmp_path / "t.parquet"
    write_trace(synth_agentic(SPEC), trace_file)
    result = CliRunner().invoke(app, ["replay", str(trace_file), "--url", "http://127.0.0.1:1"])
    assert result.exit_code == 1 and "cannot list the models" in result.output


async def test_closed_loop_without_a_recorded_gap_keeps_the_spacing_but_waits_for_the_answer(tmp_path):
    # Mooncake-like: no gaps recorded. b follows a 0.1 s after it in the trace, c follows b 0.5 s later
    cols = {
        "request_id": ["a", "b", "c"],
        "session_id": ["s", "s", "s"],
        "parent_request_id": [None, "a", "b"],
        "turn": [0, 1, 2],
        "arrival_s": [0.0, 0.1, 0.6],
        "gap_s": [None] * 3,
        "input_tokens": [20, 40, 60],
        "output_tokens": [3, 3, 3],
        "block_hashes": [chain_ids([0, 1]), chain_ids([0, 1, 2]), chain_ids([0, 1, 2, 3])],
        "cached_tokens": [None] * 3,
        "cancel_after_s": [None] * 3,
    }
    trace = make_trace(cols, TraceMeta(16, "test"))
    async with standin_cluster(tmp_path, {"n": Role.BOTH}) as c:
        engine = c.engines["n"]
        planned, _ = plan(trace, block_size=16, context_window=4096)
        engine.close_gate()  # a's answer is held: b must wait for it although its spacing has passed
        task = asyncio.create_task(run(planned, ReplaySettings(url=c.url, model=c.model, mode=Mode.CLOSED)))
        assert await asyncio.to_thread(wait_for, lambda: engine.in_flight >= 1, 10, 0.01)  # a reached the engine
        # not a synchronisation: time has to pass, well beyond b's recorded spacing (0.1 s), to show
        # that b does not leave before a's answer
        await asyncio.sleep(0.3)
        assert len(engine.bodies("/v1/completions")) == 1
        engine.open_gate()
        table = to_table(await task)
    rows = _by_id(table)
    assert all(r["status"] == "ok" for r in rows.values())
    assert rows["b"]["sent_s"] >= rows["a"]["end_s"]
    # b was answered at once (gate open), so c keeps its recorded 0.5 s after b's sending
    assert rows["c"]["sent_s"] == pytest.approx(rows["b"]["sent_s"] + 0.5, abs=0.05)
    assert rows["c"]["sent_s"] >= rows["b"]["end_s"]
