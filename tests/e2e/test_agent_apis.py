"""The Responses and Messages APIs through the cluster, with the official SDKs, P/D and colocated.

Greedy float32: each API's text equals what the same request gets from the bare engine's own endpoint
(vLLM serves /v1/responses and /v1/messages itself), on the engine behind the router's colocated path.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from contracts.secret import engine_auth_headers
from tests.e2e.conftest import LiveCluster

pytestmark = pytest.mark.e2e

ROUTES = ("disaggregated", "colocated")
TOOL = {
    "type": "function",
    "name": "read_file",
    "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
README = "# Tandem\nP/D disaggregated serving on vLLM."


def _openai(url: str, route: str | None = None, **headers: str) -> openai.OpenAI:
    extra = {"x-tandem-route": route} if route else {}
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0, default_headers={**extra, **headers}
    )


def _engine_key() -> str:
    return engine_auth_headers(loopback_only=True)["Authorization"].removeprefix("Bearer ")


def _stream_text(stream: openai.Stream) -> tuple[str, list[str], object]:
    text, kinds, final = [], [], None
    for ev in stream:
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete", "response.failed"):
            final = ev.response
    return "".join(text), kinds, final


@pytest.mark.parametrize("route", ROUTES)
def test_responses_three_turns_chained(cluster: LiveCluster, route: str) -> None:
    sdk = _openai(cluster.url, route)
    # Turn 1: the model must call the tool.
    first = sdk.responses.create(
        model=cluster.model,
        instructions="You are a coding agent.",
        input="What does README.md say?",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "read_file"},
        max_output_tokens=40,
        temperature=0,
        stream=True,
    )
    _, kinds, r1 = _stream_text(first)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    calls = [o for o in r1.output if o.type == "function_call"]
    assert calls and calls[0].name == "read_file" and "path" in json.loads(calls[0].arguments)
    # Turn 2: the tool's output, chained to turn 1.
    second = sdk.responses.create(
        model=cluster.model,
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": README}],
        tools=[TOOL],
        max_output_tokens=24,
        temperature=0,
        stream=True,
    )
    text2, kinds2, r2 = _stream_text(second)
    assert text2 and kinds2[-1] in ("response.completed", "response.incomplete")
    assert r2.usage.input_tokens > r1.usage.input_tokens
    # Turn 3: a user message chained to turn 2; the history is the router's.
    third = sdk.responses.create(
        model=cluster.model,
        previous_response_id=r2.id,
        input="Summarise that in three words.",
        max_output_tokens=16,
        temperature=0,
        stream=True,
    )
    text3, _, r3 = _stream_text(third)
    assert text3 and r3.usage.input_tokens > r2.usage.input_tokens
    # Stored: retrieve, cancel (finished: answered as it is), input items, delete.
    got = sdk.responses.retrieve(r3.id)
    assert got.id == r3.id and got.output_text == text3
    assert sdk.responses.cancel(r3.id).id == r3.id
    items = sdk.responses.input_items.list(r3.id)
    assert any(i.type == "function_call_output" for i in items.data)
    sdk.responses.delete(r3.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(r3.id)


def test_responses_text_equals_the_bare_engine(cluster: LiveCluster) -> None:
    args = dict(model=cluster.model, input="Name the three primary colors.", max_output_tokens=20, temperature=0)
    ours, _, _ = _stream_text(_openai(cluster.url, "colocated").responses.create(**args, stream=True))
    engine = openai.OpenAI(base_url=f"{cluster.both_url}/v1", api_key=_engine_key(), timeout=300, max_retries=0)
    theirs = engine.responses.create(**args, store=False)
    assert ours == theirs.output_text != ""


def _anthropic(url: str, route: str | None = None, key: str = "unused") -> anthropic.Anthropic:
    extra = {"x-tandem-route": route} if route else {}
    return anthropic.Anthropic(base_url=url, api_key=key, timeout=300, max_retries=0, default_headers=extra)


@pytest.mark.parametrize("route", ROUTES)
def test_messages_tool_round_trip(cluster: LiveCluster, route: str) -> None:
    sdk = _anthropic(cluster.url, route)
    tool = {"name": "read_file", "description": TOOL["description"], "input_schema": TOOL["parameters"]}
    messages: list[dict] = [{"role": "user", "content": "What does README.md say?"}]
    with sdk.messages.stream(
        model=cluster.model,
        system="You are a coding agent.",
        messages=messages,
        tools=[tool],
        tool_choice={"type": "tool", "name": "read_file"},
        max_tokens=40,
        extra_body={"temperature": 0},
    ) as stream:
        first = stream.get_final_message()
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and uses[0].name == "read_file" and "path" in uses[0].input
    assert first.stop_reason == "tool_use"
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": README}]},
    ]
    with sdk.messages.stream(
        model=cluster.model,
        system="You are a coding agent.",
        messages=messages,
        tools=[tool],
        max_tokens=24,
        extra_body={"temperature": 0},
    ) as stream:
        text = "".join(stream.text_stream)
        second = stream.get_final_message()
    assert text and second.stop_reason in ("end_turn", "max_tokens")
    counted = sdk.messages.count_tokens(
        model=cluster.model, system="You are a coding agent.", messages=messages, tools=[tool]
    )
    assert counted.input_tokens > 0


def test_messages_text_equals_the_bare_engine(cluster: LiveCluster) -> None:
    args = dict(
        model=cluster.model,
        messages=[{"role": "user", "content": "Name the three primary colors."}],
        max_tokens=20,
        extra_body={"temperature": 0},  # this SDK's stream() takes no temperature argument
    )
    with _anthropic(cluster.url, "colocated").messages.stream(**args) as stream:
        ours = "".join(stream.text_stream)
    theirs = _anthropic(cluster.both_url, key=_engine_key()).messages.create(**args)
    assert ours == "".join(b.text for b in theirs.content if b.type == "text") != ""


def test_errors_in_each_apis_shape(cluster: LiveCluster) -> None:
    unknown = httpx.post(
        f"{cluster.url}/v1/messages",
        json={"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
    )
    assert unknown.status_code == 404 and unknown.json()["type"] == "error"
    assert unknown.json()["error"]["type"] == "not_found_error"
    bad = httpx.post(f"{cluster.url}/v1/messages", json={"model": cluster.model, "messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.post(f"{cluster.url}/v1/responses", json={"model": "nope", "input": "x"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    over = httpx.post(
        f"{cluster.url}/v1/messages",
        json={"model": cluster.model, "max_tokens": 5, "messages": [{"role": "user", "content": "word " * 40000}]},
        timeout=120,
    )
    assert over.status_code == 400 and over.json()["error"]["type"] == "invalid_request_error", over.text
    # past the context window on the other two APIs too, in OpenAI's shape (the engine refuses; the router
    # passes its 400 on)
    long = "word " * 40000
    for path, body in (
        ("/v1/responses", {"model": cluster.model, "input": long, "max_output_tokens": 5}),
        ("/v1/chat/completions", {"model": cluster.model, "messages": [{"role": "user", "content": long}]}),
    ):
        over = httpx.post(f"{cluster.url}{path}", json=body, timeout=120)
        assert over.status_code == 400, (path, over.text)
        assert over.json()["error"]["type"] == "invalid_request_error" and over.json()["error"]["message"], over.text
