"""Responses API codec, both ways; every encoded event and object is parsed with the openai SDK's own types."""

from __future__ import annotations

import json
import typing

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from router.edge.codecs import responses
from router.edge.codecs.internal import (
    Error,
    Event,
    Finish,
    RequestError,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    collect,
    to_chat_body,
)

# The SDK's event classes by their ``type`` literal, so each event is parsed by the one class it claims to be.
_UNION = typing.get_args(ResponseStreamEvent)[0]  # Annotated[Union[...], discriminator]
EVENTS = {typing.get_args(c.model_fields["type"].annotation)[0]: c for c in typing.get_args(_UNION)}
TOOL = {"type": "function", "name": "shell", "description": "run", "parameters": {"type": "object"}, "strict": False}


def _codex_turn() -> dict:
    """A second Codex turn as it replays history: developer role, assistant item with no id/status, reasoning."""
    return {
        "model": "m",
        "instructions": "You are Codex.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: ro"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xx"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Listing."}]},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd":"ls"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
        ],
        "tools": [TOOL],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "max_output_tokens": 64,
        "temperature": 0,
        "top_p": 1,
        "store": False,
        "stream": True,
        "metadata": {"k": "v"},
        "previous_response_id": "resp_prev",
        "prompt_cache_key": "pck",
    }


def test_decode_a_codex_history_into_the_engine_body() -> None:
    req = responses.decode_request(_codex_turn(), {"session_id": "sess"})
    assert req.api == "responses"
    assert (req.hints.previous_response_id, req.hints.prompt_cache_key, req.hints.session_id) == (
        "resp_prev",
        "pck",
        "sess",
    )
    assert (req.store, req.metadata, req.max_tokens) == (False, {"k": "v"}, 64)
    body = to_chat_body(req)
    assert body["messages"] == [
        {"role": "system", "content": "You are Codex.\n\nsandbox: ro"},
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": "Listing.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd":"ls"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py"},
    ]
    assert body["tools"][0]["function"]["name"] == "shell"
    assert (body["tool_choice"], body["parallel_tool_calls"], body["max_tokens"]) == ("auto", False, 64)


def test_plain_text_input() -> None:
    req = responses.decode_request({"model": "m", "input": "hi"})
    assert to_chat_body(req)["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x"}, "model"),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        ({"model": "m", "input": "x", "tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0]"),
        ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"model": "m", "input": "x", "max_output_tokens": "9"}, "max_output_tokens"),
        ({"model": "m", "input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_input_is_a_typed_error_in_openai_shape(body: dict, param: str) -> None:
    with pytest.raises(RequestError) as info:
        responses.decode_request(body)
    assert info.value.param == param
    shaped = responses.error_body(info.value)
    assert shaped["error"]["type"] == "invalid_request_error" and shaped["error"]["param"] == param


def _run(events: list) -> list[dict]:
    req = responses.decode_request(_codex_turn())
    enc = responses.ResponsesStreamEncoder(req, "resp_abc", created_at=1700000000)
    out = enc.start()
    for ev in events:
        out += enc.feed(ev)
    for i, ev in enumerate(out):
        assert ev["sequence_number"] == i
        EVENTS[ev["type"]].model_validate(ev, strict=False)  # the SDK's own class parses every event
        assert responses.sse(ev).startswith(f"event: {ev['type']}\ndata: ".encode())
    return out


def test_stream_text_then_tool_call_in_the_documented_order() -> None:
    events: list[Event] = [
        TextDelta("I will "),
        TextDelta("run ls."),
        ToolCallStart(0, "call_9", "shell"),
        ToolCallArgsDelta(0, '{"cmd":'),
        ToolCallArgsDelta(0, '"ls"}'),
        ToolCallEnd(0),
        Usage(100, 96, 12),
        Finish("tool_calls"),
    ]
    out = _run(events)
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert out[6]["text"] == "I will run ls."
    assert out[9]["output_index"] == 1 and out[9]["item"]["call_id"] == "call_9"
    assert out[12]["arguments"] == '{"cmd":"ls"}'
    final = Response.model_validate(out[-1]["response"])
    assert final.status == "completed"
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.input_tokens_details.cached_tokens, final.usage.output_tokens) == (
        100,
        96,
        12,
    )
    assert final.output_text == "I will run ls."
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.previous_response_id == "resp_prev"

    # The same events gathered give the same object to a request that does not stream.
    built = responses.build_response(responses.decode_request(_codex_turn()), collect(events), "resp_abc", 1700000000)
    assert built == out[-1]["response"]
    assert json.loads(json.dumps(built)) == built


def test_length_finish_is_incomplete() -> None:
    out = _run([TextDelta("abc"), Usage(5, 0, 64), Finish("length")])
    assert out[-1]["type"] == "response.incomplete"
    final = Response.model_validate(out[-1]["response"])
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    assert out[-2]["item"]["status"] == "incomplete"


def test_error_mid_stream_fails_the_response_and_ends_the_stream() -> None:
    out = _run([TextDelta("part"), Error("capacity", "no decode node free"), TextDelta("ignored")])
    assert [e["type"] for e in out][-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    final = Response.model_validate(out[-1]["response"])
    assert final.status == "failed" and final.error is not None
    assert (final.error.code, final.error.message) == ("rate_limit_exceeded", "no decode node free")
    failed: list[Event] = [TextDelta("x"), Error("upstream", "boom")]
    built = responses.build_response(responses.decode_request(_codex_turn()), collect(failed))
    assert built["status"] == "failed" and built["error"]["code"] == "server_error"
