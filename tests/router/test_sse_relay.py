"""The relay's per-chunk rules on raw engine payloads: unchanged chunks pass byte for byte, a foreign
engine id is replaced by the router's, the usage chunk gets the hit-rate breakdown and is forwarded
only when asked for, and the trace collects text, tool calls, finish reason and token times."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

from contracts.errors import UpstreamError
from router.orchestrator import RequestTrace
from router.sse import RelayResponse

RID = "chatcmpl-0123456789abcdef"


def _chunk(rid: str, delta: dict, finish: str | None = None) -> bytes:
    return json.dumps({"id": rid, "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]},
                      separators=(",", ":")).encode()


USAGE = json.dumps({"id": RID, "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}).encode()


async def _batches(batches: list[list[bytes]]) -> AsyncIterator[list[bytes]]:
    for b in batches:
        yield b


async def _run(batches: list[list[bytes]], include_usage: bool, *, fail: bool = False
               ) -> tuple[bytes, RequestTrace, list]:
    trace = RequestTrace(request_id=RID, kind="chat", model="m")
    finished: list = []
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def source() -> AsyncIterator[list[bytes]]:
        async for b in _batches(batches):
            yield b
        if fail:
            raise UpstreamError("stream from node broke: ConnectionResetError")

    closed: list[bool] = []
    stack = AsyncExitStack()
    stack.callback(lambda: closed.append(True))
    response = RelayResponse(source(), stack, trace, include_usage, lambda st, e: finished.append((st, e)))
    await response.stream_response(send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert sent[-1]["more_body"] is False and all(m["more_body"] for m in sent[1:-1])
    assert closed == [True]  # the upstream stream is closed whatever happened
    return b"".join(m["body"] for m in sent[1:]), trace, finished


def _events(out: bytes) -> list[bytes]:
    assert out.endswith(b"data: [DONE]\n\n")
    return [e[len(b"data: "):] for e in out.split(b"\n\n") if e]


async def test_unchanged_chunks_pass_byte_for_byte_and_usage_is_dropped_unless_asked() -> None:
    first, second = _chunk(RID, {"role": "assistant", "content": ""}), _chunk(RID, {"content": "Hi"})
    last = _chunk(RID, {}, "stop")
    out, trace, finished = await _run([[first, second], [last, USAGE]], include_usage=False)
    assert _events(out) == [first, second, last, b"[DONE]"]
    assert trace.content == ["Hi"] and trace.finish_reason == "stop"
    assert trace.prompt_tokens == 5 and trace.completion_tokens == 2
    assert len(trace.token_times) == 1 and trace.first_token == trace.token_times[0]
    assert finished == [("ok", None)]


async def test_usage_chunk_carries_the_breakdown_when_asked() -> None:
    out, trace, _ = await _run([[_chunk(RID, {"content": "x"}), USAGE]], include_usage=True)
    usage = json.loads(_events(out)[1])
    assert usage["id"] == RID and usage["usage"]["prompt_tokens"] == 5
    assert set(usage["usage"]["tandem"]) >= {"fleet_cached_tokens", "routed_cached_tokens", "policy", "mode"}
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_foreign_engine_id_is_replaced_and_tool_calls_are_collected() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"p":'}}
    more = {"index": 0, "function": {"arguments": '"a.py"}'}}
    out, trace, _ = await _run([[_chunk("chatcmpl-engine-own-id", {"tool_calls": [call]})],
                                [_chunk("chatcmpl-engine-own-id", {"tool_calls": [more]}, "tool_calls")]],
                               include_usage=False)
    events = [json.loads(e) for e in _events(out)[:-1]]
    assert [e["id"] for e in events] == [RID, RID]
    assert trace.tool_calls == {0: {"id": "call_1", "name": "read", "arguments": '{"p":"a.py"}'}}
    assert trace.finish_reason == "tool_calls"


async def test_a_stream_that_breaks_after_tokens_ends_with_an_error_event() -> None:
    out, trace, finished = await _run([[_chunk(RID, {"content": "partial"})]], include_usage=False, fail=True)
    events = [e for e in out.split(b"\n\n") if e]
    assert events[0] == b"data: " + _chunk(RID, {"content": "partial"})
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][len(b"data: "):])
    assert "broke" in error["error"]["message"]
    assert finished[0][0] == "error" and trace.content == ["partial"]
