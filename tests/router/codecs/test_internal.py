"""The internal request to the engine's chat body, and the engine's chunks back into internal events."""

from __future__ import annotations

from router.edge.codecs.internal import (
    ChatChunkReader,
    Error,
    Finish,
    InternalRequest,
    Message,
    TextDelta,
    Tool,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolChoice,
    Usage,
    collect,
    hints_from_headers,
    to_chat_body,
)


def _chunk(delta: dict | None = None, finish: str | None = None, **extra: object) -> dict:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish, **extra}]}


def test_chat_body_joins_system_messages_and_renders_a_tool_round_trip() -> None:
    req = InternalRequest(
        api="responses",
        model="m",
        messages=(
            Message("system", "be brief"),
            Message("system", "use tools"),
            Message("user", "weather?"),
            Message("assistant", "", (ToolCall("call_1", "get_weather", '{"city":"Oslo"}'),)),
            Message("tool", "sunny", tool_call_id="call_1"),
        ),
        tools=(Tool("get_weather", "weather now", {"type": "object"}),),
        tool_choice=ToolChoice("function", "get_weather"),
        parallel_tool_calls=False,
        temperature=0.0,
        max_tokens=16,
        stop=("END",),
        stream=True,
    )
    assert to_chat_body(req) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief\n\nuse tools"},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_weather", "description": "weather now", "parameters": {"type": "object"}},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "temperature": 0.0,
        "max_tokens": 16,
        "stop": ["END"],
    }


def test_reader_holds_the_finish_until_the_usage_chunk() -> None:
    r = ChatChunkReader()
    events = [
        *r.feed(_chunk({"role": "assistant", "content": ""})),
        *r.feed(_chunk({"content": "Hel"})),
        *r.feed(_chunk({"content": "lo"}, finish="stop", stop_reason="END")),
        *r.feed(
            {
                "choices": [],
                "usage": {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}},
            }
        ),
        *r.close(),
    ]
    assert events == [TextDelta("Hel"), TextDelta("lo"), Usage(10, 8, 2), Finish("stop", "END")]


def test_reader_tool_calls_one_after_another() -> None:
    r = ChatChunkReader()
    events = [
        *r.feed(
            _chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": "c0", "type": "function", "function": {"name": "a", "arguments": ""}}
                    ]
                }
            )
        ),
        *r.feed(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]})),
        *r.feed(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})),
        *r.feed(_chunk({"tool_calls": [{"index": 1, "id": "c1", "function": {"name": "b", "arguments": "{}"}}]})),
        *r.feed(_chunk({}, finish="tool_calls")),
        *r.close(),
    ]
    assert events == [
        ToolCallStart(0, "c0", "a"),
        ToolCallArgsDelta(0, '{"x":'),
        ToolCallArgsDelta(0, "1}"),
        ToolCallEnd(0),
        ToolCallStart(1, "c1", "b"),
        ToolCallArgsDelta(1, "{}"),
        ToolCallEnd(1),
        Finish("tool_calls"),
    ]
    done = collect(events)
    assert done.output == [ToolCall("c0", "a", '{"x":1}'), ToolCall("c1", "b", "{}")]


def test_reader_error_chunk_and_a_stream_cut_short_are_errors() -> None:
    r = ChatChunkReader()
    assert r.feed(_chunk({"content": "a"})) == [TextDelta("a")]
    assert r.feed({"error": {"message": "engine died", "code": 500}}) == [Error("upstream", "engine died")]
    assert r.feed(_chunk({"content": "late"})) == []
    assert r.close() == []

    cut = ChatChunkReader()
    cut.feed(_chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f"}}]}))
    closing = cut.close()
    assert closing[0] == ToolCallEnd(0)
    assert isinstance(closing[1], Error) and closing[1].kind == "upstream"


def test_hints_from_the_agents_headers() -> None:
    claude = hints_from_headers({"X-Claude-Code-Session-Id": "s1", "x-claude-code-agent-id": "a2"}, user="u")
    assert (claude.session_id, claude.agent_id, claude.user) == ("s1", "a2", "u")
    codex = hints_from_headers({"session_id": "s2", "thread-id": "t"}, previous_response_id="resp_1")
    assert (codex.session_id, codex.conversation_id, codex.previous_response_id) == ("s2", "t", "resp_1")
