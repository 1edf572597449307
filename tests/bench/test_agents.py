"""``tandem bench agents`` without engines: a workload turn re-encoded as each API's tool call and tool
result, each API's stream read into text and usage, and the per-arm summary and RESULT line."""

from __future__ import annotations

import json

import pytest

from bench.agent_apis import Usage, chat_body, messages_body, read_event, responses_body, structure
from bench.agents import ArmRun, Turn, result_line, summarize, transport_verdict
from bench.loadgen import RequestResult

TURN = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Repository acme. Task 1: fix it."},
    {"role": "assistant", "content": 'The cache looks wrong.\nCalling grep("block_index").'},
    {"role": "user", "content": "Output of grep:\nsrc/a.py:1: x = y"},
]


def test_structure_pairs_the_scripted_call_with_its_output() -> None:
    system, items = structure(TURN)
    assert system == "You are a coding agent."
    assert [(i.kind, i.tool) for i in items] == [("user", ""), ("assistant", ""), ("call", "grep"), ("result", "grep")]
    assert items[1].text == "The cache looks wrong."
    assert json.loads(items[2].text) == {"arg": "block_index"}
    assert items[2].call_id == items[3].call_id and items[3].text == "src/a.py:1: x = y"


def test_each_api_carries_the_call_and_its_result_in_its_own_shape() -> None:
    system, items = structure(TURN)
    chat = chat_body("m", system, items, 8)["messages"]
    assert chat[2]["tool_calls"][0]["function"]["name"] == "grep"
    assert chat[3] == {"role": "tool", "tool_call_id": chat[2]["tool_calls"][0]["id"], "content": "src/a.py:1: x = y"}

    resp = responses_body("m", system, items, 8)
    assert resp["instructions"] == system and resp["max_output_tokens"] == 8
    kinds = [x["type"] for x in resp["input"]]
    assert kinds == ["message", "message", "function_call", "function_call_output"]
    assert resp["input"][2]["call_id"] == resp["input"][3]["call_id"]

    msgs = messages_body("m", system, items, 8)
    assert [m["role"] for m in msgs["messages"]] == ["user", "assistant", "user"]
    use = msgs["messages"][1]["content"][1]
    assert use["type"] == "tool_use" and use["input"] == {"arg": "block_index"}
    assert msgs["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": use["id"], "content": "src/a.py:1: x = y"}
    ]
    assert all(len(b["tools"]) == 6 for b in (chat_body("m", system, items, 8), resp, msgs))


def test_stream_readers_find_text_usage_and_errors() -> None:
    u = Usage()
    assert read_event("chat", {"choices": [{"delta": {"content": "hi"}}]}, u) == (True, None)
    usage = {"prompt_tokens": 100, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 64}}
    read_event("chat", {"choices": [], "usage": usage}, u)
    assert (u.prompt_tokens, u.cached_tokens, u.output_tokens) == (100, 64, 3)

    u = Usage()
    assert read_event("responses", {"type": "response.output_text.delta", "delta": "x"}, u) == (True, None)
    done = {"input_tokens": 90, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 32}}
    read_event("responses", {"type": "response.completed", "response": {"usage": done}}, u)
    assert (u.prompt_tokens, u.cached_tokens) == (90, 32)
    capped = {"type": "response.incomplete", "response": {"usage": {**done, "input_tokens": 91}}}
    assert read_event("responses", capped, u) == (False, None) and u.prompt_tokens == 91
    failed = {"type": "response.failed", "response": {"error": {"code": "server_error"}}}
    assert read_event("responses", failed, u)[1] is not None

    u = Usage()
    start = {"input_tokens": 10, "cache_read_input_tokens": 64, "cache_creation_input_tokens": 26}
    read_event("messages", {"type": "message_start", "message": {"usage": start}}, u)
    delta = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "ok"}}
    assert read_event("messages", delta, u) == (True, None)
    read_event("messages", {"type": "message_delta", "usage": {"output_tokens": 5}}, u)
    assert (u.prompt_tokens, u.cached_tokens, u.output_tokens) == (100, 64, 5)
    final = {"input_tokens": 4, "cache_read_input_tokens": 96, "output_tokens": 6}  # vLLM's: the final counts
    read_event("messages", {"type": "message_delta", "usage": final}, u)
    assert (u.prompt_tokens, u.cached_tokens, u.output_tokens) == (100, 96, 6)
    error = {"type": "error", "error": {"type": "overloaded_error"}}
    assert read_event("messages", error, u) == (False, "{'type': 'overloaded_error'}")


def _ok(ttft: float, itl: list[float], prompt: int, cached: int) -> RequestResult:
    return RequestResult(
        ok=True, ttft_s=ttft, e2e_s=ttft + sum(itl), itl_s=itl, usage={"prompt_tokens": prompt, "cached_tokens": cached}
    )


def test_summary_pools_rounds_and_counts_errors() -> None:
    r0 = ArmRun(
        "tandem_messages",
        0,
        [Turn("s", 0, _ok(0.1, [0.02, 0.04], 100, 0)), Turn("s", 1, _ok(0.3, [], 200, 100))],
        {"s": 5.0},
        6.0,
    )
    bad = RequestResult(ok=False, error="503: overloaded")
    r1 = ArmRun("tandem_messages", 1, [Turn("t", 0, _ok(0.2, [0.03], 100, 50)), Turn("u", 0, bad)], {"t": 7.0}, 8.0)
    s = summarize([r0, r1])
    assert (s["requests"], s["errors"], s["error_samples"], s["sessions_complete"]) == (4, 1, ["503: overloaded"], 2)
    assert s["ttft_p50_ms"] == pytest.approx(200.0) and s["itl_p50_ms"] == pytest.approx(30.0)
    assert s["hit"] == pytest.approx(150 / 400) and s["session_p50_s"] == pytest.approx(6.0)
    assert s["wall_s"] == 14.0
    empty = summarize([ArmRun("engine_chat", 0, [Turn("s", 0, bad)], {}, 1.0)])
    assert empty["ttft_p50_ms"] is None and empty["hit"] is None and empty["errors"] == 1

    line = result_line({"arms": {"tandem_messages": s, "engine_chat": empty}})
    assert line.startswith("RESULT agents tandem_messages_ttft_p50_ms=200.0 ")
    assert "tandem_messages_hit=0.375" in line and line.endswith("engine_chat_errors=1")


def test_summary_overhead_is_ttft_less_the_engines_time() -> None:
    run = ArmRun(
        "tandem_responses-ws", 0, [Turn("s", 0, _ok(0.3, [], 10, 0)), Turn("s", 1, _ok(0.5, [], 10, 0))], {}, 1.0
    )
    run.engine_s = 0.6  # the engines queued and prefilled for 0.6 s of the 0.8 s of TTFT
    assert summarize([run])["overhead_ms"] == pytest.approx(100.0)
    sse = ArmRun("tandem_responses-chain", 0, [Turn("s", 0, _ok(0.4, [], 10, 0))], {}, 1.0)
    arms = {"tandem_responses-ws": summarize([run]), "tandem_responses-chain": summarize([sse])}
    verdict = transport_verdict(arms)
    assert verdict == {"ws_over_sse_overhead": 0.25, "target": 0.7, "held": True}
    line = result_line({"arms": arms, "transport": verdict})
    assert line.endswith("ws_over_sse_overhead=0.25 ws_target_held=True")
    assert transport_verdict({"tandem_responses-ws": arms["tandem_responses-ws"]}) is None


async def test_chained_arms_send_the_engines_the_same_prompts_over_sse_and_a_socket(tmp_path) -> None:
    """The two transport arms on stand-in engines: every turn answered, and turn for turn the engine gets
    the same conversation whether the chain came over SSE (read back from the store) or a socket."""
    from bench.agents import AgentsBenchConfig, Target, run_arm
    from bench.loadgen import SessionScript
    from contracts.registry import Role
    from tests.support.standin_cluster import standin_cluster

    history: list[dict[str, str]] = [TURN[0], TURN[1]]
    turns = [list(history), [*TURN], [*TURN, {"role": "assistant", "content": "ok"}, TURN[1]]]
    script = SessionScript("sess-1", 0.0, turns, [0.0, 0.0])
    cfg = AgentsBenchConfig(concurrency=1, max_tokens=4)
    seen: dict[str, list[list[dict[str, object]]]] = {}
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 4}) as c:
        engine = c.engines["n"]
        for arm in ("tandem_responses-chain", "tandem_responses-ws"):
            start = len(engine.received)
            run = await run_arm(arm, 0, Target((c.url,), {}), c.model, [script], cfg)
            assert [t.result.ok for t in run.turns] == [True, True, True], [t.result.error for t in run.turns]
            seen[arm] = [body["messages"] for _, body in engine.received[start:]]
    assert len(seen["tandem_responses-ws"]) == 3 and seen["tandem_responses-ws"] == seen["tandem_responses-chain"]
    last = seen["tandem_responses-ws"][-1]
    assert last[0]["role"] == "system" and sum(m["role"] == "system" for m in last) == 1
