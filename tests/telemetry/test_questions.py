"""``tandem lake questions``: every catalogued statement runs, as printed, against a lake written by the
real emitter and lake writer from the router's own request records, and returns rows."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from router.kv_index import PrefixView
from router.planning.orchestrator import RequestTrace
from router.policies import ReasonCode
from router.record.records import request_record
from tandem.cli import app
from telemetry.query import query
from telemetry.questions import QUESTIONS

runner = CliRunner()


def _traces() -> list[RequestTrace]:
    """Three agent sessions of four turns: P/D and colocated, tool calls, KV transfers, misses."""
    t0 = time.time() - 600
    out = []
    for s in range(3):
        for turn in range(4):
            arrival = t0 + s * 100 + turn * (2 + 10 * s)  # pauses of 1, 11 and 21 s between turns
            pd = (s + turn) % 2 == 0
            p = 300 + turn * 900
            tr = RequestTrace(request_id=f"chatcmpl-{s}-{turn}", kind="chat", model="m", arrival=arrival)
            tr.session_id, tr.tenant_id, tr.stream, tr.status = f"sess-{s}", "acme", True, "ok"
            tr.routed, tr.first_token, tr.finish = arrival + 0.01, arrival + 0.2 + p / 1e4, arrival + 1
            tr.prompt_tokens, tr.completion_tokens = p, 16
            tr.mode = "disaggregated" if pd else "colocated"
            tr.prefill_node = "p0" if pd else None
            tr.decode_node, tr.decode_role = ("d0", "decode") if pd else ("b0", "both")
            tr.finish_reason = "tool_calls" if turn % 2 == 0 else "stop"
            tr.policy, tr.reason = "cache_aware", "display text"
            tr.reason_code = ReasonCode.BEST_PREFIX if turn else ReasonCode.LOAD_GUARD
            tr.decode_reason_code = ReasonCode.LEAST_BUSY
            tr.engine_cached_tokens = turn * 256
            tr.prefix_view = PrefixView(
                prompt_tokens=p,
                fleet_tokens=turn * 512,
                routed_tokens=turn * 256,
                seen_tokens=turn * 640,
                elsewhere_node="p1" if turn else None,
                elsewhere_reason="load_guard" if turn else None,
                evicted_node="p1",
                evicted_tier="GPU",
                evicted_ago_s=3.0,
            )
            if pd:
                tr.kv_connector = "tandem"
                tr.transfer = {"bytes": p * 23_040, "seconds": p * 2e-5, "transport": "shm", "start": arrival + 0.1}
            tr.token_times = [tr.first_token + i * 0.03 for i in range(16)]
            out.append(tr)
    return out


@pytest.fixture
def filled(make_emitter, make_writer, lake):
    e = make_emitter(start=False)
    for tr in _traces():
        e.emit("requests", request_record(tr, endpoint="chat", http_status=200))
    e.emit("requests", {"request_id": "refused", "status": "rejected", "http_status": 400, "prompt_tokens": 10**7})
    e.flush()
    assert make_writer().drain().rows == 13
    return lake


@pytest.mark.parametrize("q", QUESTIONS, ids=lambda q: q.name)
def test_every_question_runs_as_printed_and_returns_rows(q, filled) -> None:
    rows = query(filled, q.sql).to_pylist()
    assert rows, q.name
    res = runner.invoke(app, ["lake", "questions", q.name, "--sql"])
    assert res.exit_code == 0 and res.stdout.strip() == q.sql + ";"
    res = runner.invoke(app, ["lake", "query", res.stdout, "--lake", str(filled), "--format", "json"])
    assert res.exit_code == 0, res.output
    assert [json.loads(line) for line in res.stdout.splitlines()] == json.loads(json.dumps(rows, default=str))


def test_answers_are_the_ones_the_lake_implies(filled) -> None:
    by = {q.name: q for q in QUESTIONS}
    [why] = query(filled, by["session_turn_miss"].sql).to_pylist()
    assert (why["session_id"], why["turn"]) == ("sess-2", 4)  # the latest session's last turn
    assert why["uncached_tokens"] == 3000 - 768
    kinds = ("miss_cold_tokens", "miss_evicted_tokens", "miss_elsewhere_tokens", "miss_undelivered_tokens")
    assert sum(why[k] for k in kinds) == why["uncached_tokens"]
    assert why["miss_elsewhere_reason"] == "load_guard" and why["routing_reason_code"] == "best_prefix"
    pauses = query(filled, by["hit_rate_by_tool_pause"].sql).to_pylist()
    assert [(r["pause"], r["after_tool_call"], r["requests"]) for r in pauses] == [
        ("1-5 s", False, 1),
        ("1-5 s", True, 2),
        ("5-30 s", False, 2),
        ("5-30 s", True, 4),
    ]
    assert sum(r["requests"] for r in pauses) == 9  # every turn after the first, rejected request left out
    [shm] = query(filled, by["transfer_s_per_gb_by_transport"].sql).to_pylist()
    assert (shm["connector"], shm["transport"], shm["transfers"]) == ("tandem", "shm", 6)
    assert shm["s_per_gb"] == pytest.approx(2e-5 / 23_040 * 1e9, rel=1e-3)
    ttft = query(filled, by["pd_vs_colocated_ttft_by_prompt_length"].sql).to_pylist()
    assert {r["routing_decision"] for r in ttft} == {"pd", "colocated"}
    kinds_rows = query(filled, by["uncached_tokens_by_miss_kind"].sql).to_pylist()
    total = query(filled, "SELECT sum(uncached_tokens) AS u FROM requests").to_pylist()[0]["u"]
    assert sum(r["tokens"] for r in kinds_rows) == total


def test_the_catalogue_and_run_from_the_command_line(filled) -> None:
    res = runner.invoke(app, ["lake", "questions"])
    assert res.exit_code == 0
    for q in QUESTIONS:
        assert f"-- {q.name}: " in res.stdout and q.sql in res.stdout
    res = runner.invoke(app, ["lake", "questions", "--run", "--lake", str(filled), "--format", "json"])
    assert res.exit_code == 0, res.output
    assert len(res.stdout.splitlines()) >= len(QUESTIONS)
    res = runner.invoke(app, ["lake", "questions", "nope"])
    assert res.exit_code == 2 and "unknown question 'nope'" in res.output
