"""The Responses API over one WebSocket through the live P/D cluster (issue 39), with the official
``openai`` SDK's WebSocket mode (``client.responses.connect()``) and the ``websockets`` library.

Greedy float32: a five-turn agent session with a function call, chained by ``previous_response_id``, gives
the same output on one socket as the same turns over SSE, turn by turn; a second ``response.create``
while one is in flight is an ``error`` event; ``response.cancel`` mid-response ends the engines' work
(their running and waiting requests back to zero). The node killed mid-response is in
``tests/e2e/test_supervision.py`` (its own cluster), which shares nothing with this session's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
import websockets

from tests.e2e.conftest import LiveCluster, engine_metric, wait_for
from tests.e2e.test_agent_apis import README, TOOL

pytestmark = pytest.mark.e2e

ROUTE = {"x-tandem-route": "disaggregated"}
INSTRUCTIONS = "You are a coding agent. Use the tools to read files before answering."
TURNS: list[dict[str, Any]] = [
    {"input": "What does README.md say?", "tool_choice": {"type": "function", "name": "read_file"}},
    {"tool_output": README},
    {"input": "Which file would you read next, and why?"},
    {"input": "Now read pyproject.toml.", "tool_choice": {"type": "function", "name": "read_file"}},
    {"tool_output": "[project]\nname = 'tandem'\nrequires-python = '>=3.11'"},
]


def _turn_body(model: str, i: int, previous: Any | None) -> dict[str, Any]:
    """Turn ``i`` of the session, chained on ``previous`` (the Response object of turn ``i - 1``)."""
    turn = TURNS[i]
    body: dict[str, Any] = {
        "model": model,
        "instructions": INSTRUCTIONS,
        "tools": [TOOL],
        "max_output_tokens": 32,
        "temperature": 0,
    }
    if "tool_choice" in turn:
        body["tool_choice"] = turn["tool_choice"]
    if previous is not None:
        body["previous_response_id"] = previous.id
    if "tool_output" in turn:
        call = next(o for o in previous.output if o.type == "function_call")
        body["input"] = [{"type": "function_call_output", "call_id": call.call_id, "output": turn["tool_output"]}]
    else:
        body["input"] = turn["input"]
    return body


def _summary(response: Any) -> list[tuple[str, str]]:
    """What a turn produced, comparable across transports (ids differ): (type, text or name+arguments)."""
    out = []
    for item in response.output:
        if item.type == "function_call":
            out.append(("function_call", f"{item.name} {item.arguments}"))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content if c.type == "output_text")))
    return out


def _over_sse(cluster: LiveCluster) -> list[list[tuple[str, str]]]:
    sdk = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, default_headers=ROUTE)
    previous, turns = None, []
    for i in range(len(TURNS)):
        final = None
        for ev in sdk.responses.create(**_turn_body(cluster.model, i, previous), stream=True):
            if ev.type in ("response.completed", "response.incomplete", "response.failed"):
                final = ev.response
        assert final is not None and final.status != "failed", final
        turns.append(_summary(final))
        previous = final
    return turns


async def _over_socket(cluster: LiveCluster) -> list[list[tuple[str, str]]]:
    sdk = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, default_headers=ROUTE)
    previous, turns = None, []
    async with sdk.responses.connect() as conn:
        for i in range(len(TURNS)):
            await conn.response.create(**_turn_body(cluster.model, i, previous))
            final = None
            async for ev in conn:
                if ev.type in ("response.completed", "response.incomplete", "response.failed"):
                    final = ev.response
                    break
                assert ev.type != "error", ev
            assert final is not None and final.status != "failed", final
            turns.append(_summary(final))
            previous = final
    return turns


def test_a_five_turn_session_on_one_socket_equals_sse(cluster: LiveCluster) -> None:
    sse = _over_sse(cluster)
    socket = asyncio.run(_over_socket(cluster))
    assert socket == sse
    calls = [kind for turn in socket for kind, _ in turn if kind == "function_call"]
    assert len(calls) >= 2 and all(turn for turn in socket), socket


def _busy(urls: tuple[str, ...]) -> float:
    return sum(
        engine_metric(u, "vllm:num_requests_running") + engine_metric(u, "vllm:num_requests_waiting") for u in urls
    )


async def _cancel_mid_response(cluster: LiveCluster) -> tuple[str, str]:
    url = cluster.url.replace("http://", "ws://") + "/v1/responses"
    async with websockets.connect(url, additional_headers=ROUTE) as ws:
        create = {
            "type": "response.create",
            "model": cluster.model,
            "input": "Count from 1 to 1000, one number per line.",
            "max_output_tokens": 1000,
            "temperature": 0,
        }
        await ws.send(json.dumps(create))
        while json.loads(await asyncio.wait_for(ws.recv(), 300))["type"] != "response.output_text.delta":
            pass
        await ws.send(json.dumps(create))  # one response at a time: an error event, the first goes on
        while (busy := json.loads(await asyncio.wait_for(ws.recv(), 60)))["type"] != "error":
            assert busy["type"].startswith("response.")
        await ws.send(json.dumps({"type": "response.cancel"}))
        while (ended := json.loads(await asyncio.wait_for(ws.recv(), 60)))["type"] != "error":
            assert ended["type"].startswith("response.") and ended["type"] != "response.completed"
        return busy["error"]["code"], ended["error"]["code"]


def test_one_response_at_a_time_and_cancel_frees_the_engines(cluster: LiveCluster) -> None:
    engines = (cluster.prefill_url, cluster.decode_url)
    generated = sum(engine_metric(u, "vllm:generation_tokens_total") for u in engines)
    busy, ended = asyncio.run(_cancel_mid_response(cluster))
    assert (busy, ended) == ("response_in_progress", "response_cancelled")
    assert wait_for(lambda: _busy(engines) == 0, timeout_s=120), "the engines still run the cancelled response"
    after = sum(engine_metric(u, "vllm:generation_tokens_total") for u in engines)
    assert after - generated < 1000, "the cancelled response ran to its end"
