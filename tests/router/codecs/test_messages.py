"""Anthropic Messages codec, both ways; every encoded event and message is parsed with the anthropic SDK's types."""

from __future__ import annotations

import json
import typing

import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent

from router.edge.codecs import messages
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

_UNION = typing.get_args(RawMessageStreamEvent)[0]  # Annotated[Union[...], discriminator]
EVENTS = {typing.get_args(c.model_fields["type"].annotation)[0]: c for c in typing.get_args(_UNION)}
BILLING = "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=8f3a1;"


def _claude_turn() -> dict:
    """A Claude Code turn after one tool call, as it sends it to /v1/messages?beta=true."""
    return {
        "model": "m",
        "max_tokens": 32,
        "system": [
            {"type": "text", "text": BILLING},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "read a.py"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.py"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "print(1)"}],
                    },
                    {"type": "text", "text": "now explain"},
                ],
            },
        ],
        "tools": [{"name": "Read", "description": "read a file", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["\n\nHuman:"],
        "temperature": 0,
        "top_k": 1,
        "metadata": {"user_id": "user_abc"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "stream": True,
    }


def test_decode_a_claude_code_turn_strips_the_billing_line() -> None:
    req = messages.decode_request(_claude_turn(), {"x-claude-code-session-id": "cc-1"})
    assert (req.api, req.hints.session_id, req.hints.user) == ("messages", "cc-1", "user_abc")
    body = to_chat_body(req)
    assert body["messages"] == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "read a.py"},
        {
            "role": "assistant",
            "content": "Reading.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "Read", "arguments": '{"path": "a.py"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "print(1)"},
        {"role": "user", "content": "now explain"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "Read", "description": "read a file", "parameters": {"type": "object"}},
        }
    ]
    assert (body["tool_choice"], body["parallel_tool_calls"]) == ("required", False)
    assert (body["stop"], body["max_tokens"], body["top_k"]) == (["\n\nHuman:"], 32, 1)


def test_billing_line_inside_a_text_system_prompt() -> None:
    assert messages.strip_billing_header(f"{BILLING}\nYou are X.") == "You are X."
    assert messages.strip_billing_header("no header here") == "no header here"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}
                ],
            },
            "messages.0.content.0",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "x"},
            },
            "tool_choice.type",
        ),
    ],
)
def test_bad_input_is_a_typed_error(body: dict, param: str) -> None:
    with pytest.raises(RequestError) as info:
        messages.decode_request(body)
    assert info.value.param == param
    shaped = ErrorResponse.model_validate(
        {**messages.error_body("invalid_request", info.value.message), "request_id": None}
    )
    assert shaped.error.type == "invalid_request_error"


def test_image_refusal_says_why() -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}
    with pytest.raises(RequestError, match="no vision"):
        messages.decode_request(body)


def _run(events: list, prompt_tokens: int = 0) -> list[dict]:
    enc = messages.MessagesStreamEncoder(messages.decode_request(_claude_turn()), "msg_abc")
    out = enc.start(prompt_tokens)
    for ev in events:
        out += enc.feed(ev)
    for ev in out:
        if ev["type"] != "error":
            EVENTS[ev["type"]].model_validate(ev)  # the SDK's own class parses every event
        assert messages.sse(ev).startswith(f"event: {ev['type']}\ndata: ".encode())
    return out


def test_stream_text_then_tool_use_in_the_documented_order() -> None:
    events: list[Event] = [
        TextDelta("Let me "),
        TextDelta("look."),
        ToolCallStart(0, "toolu_9", "Read"),
        ToolCallArgsDelta(0, '{"path":'),
        ToolCallArgsDelta(0, '"b.py"}'),
        ToolCallEnd(0),
        Usage(200, 192, 9),
        Finish("tool_calls"),
    ]
    out = _run(events, prompt_tokens=200)
    assert [(e["type"], e.get("index")) for e in out] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert out[1]["content_block"] == {"type": "text", "text": ""}
    assert out[5]["content_block"] == {"type": "tool_use", "id": "toolu_9", "name": "Read", "input": {}}
    assert out[6]["delta"] == {"type": "input_json_delta", "partial_json": '{"path":'}
    assert out[9]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[9]["usage"] == {
        "input_tokens": 8,
        "cache_read_input_tokens": 192,
        "cache_creation_input_tokens": 0,
        "output_tokens": 9,
    }

    built = Message.model_validate(
        messages.build_message(messages.decode_request(_claude_turn()), collect(events), "msg_abc")
    )
    assert built.stop_reason == "tool_use"
    assert [b.type for b in built.content] == ["text", "tool_use"]
    assert built.content[0].text == "Let me look."  # type: ignore[union-attr]
    assert built.content[1].input == {"path": "b.py"}  # type: ignore[union-attr]
    assert (built.usage.cache_read_input_tokens, built.usage.input_tokens) == (192, 8)


def test_stop_sequence_and_length_finishes() -> None:
    out = _run([TextDelta("a"), Usage(3, 0, 1), Finish("stop", "\n\nHuman:")])
    assert out[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n\nHuman:"}
    out = _run([TextDelta("a"), Usage(3, 0, 32), Finish("length")])
    assert out[-2]["delta"]["stop_reason"] == "max_tokens"


def test_error_mid_stream_is_anthropics_error_event_and_ends_the_stream() -> None:
    out = _run([TextDelta("par"), Error("capacity", "no decode node free"), TextDelta("ignored"), Finish("stop")])
    assert [e["type"] for e in out] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert out[-1] == {"type": "error", "error": {"type": "overloaded_error", "message": "no decode node free"}}
    ErrorResponse.model_validate({**out[-1], "request_id": None})
    assert messages.sse(messages.MessagesStreamEncoder.ping()) == b'event: ping\ndata: {"type":"ping"}\n\n'
    frame = messages.sse(out[-1]).decode()
    assert json.loads(frame.split("data: ", 1)[1]) == out[-1]
    failed: list[Event] = [TextDelta("x"), Error("upstream", "boom")]
    built = messages.build_message(messages.decode_request(_claude_turn()), collect(failed))
    assert built == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


def test_an_integer_past_the_engines_range_is_the_clients_error() -> None:
    """JSON integers are unbounded; vLLM's are 32-bit (a top_k of 9.6e20 was a 500 from the engine)."""
    body = {
        "model": "m",
        "max_tokens": 5,
        "top_k": 965813819780996661248,
        "messages": [{"role": "user", "content": "x"}],
    }
    with pytest.raises(RequestError) as err:
        messages.decode_request(body)
    assert err.value.param == "top_k"
    assert messages.decode_request({**body, "top_k": 40}).top_k == 40
