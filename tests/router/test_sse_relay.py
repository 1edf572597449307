"""The relay's per-chunk rules on raw engine payloads: unchanged chunks pass byte for byte, a foreign
engine id is replaced by the router's, the usage chunk gets the hit-rate breakdown and is forwarded
only when asked for, and the trace collects text, tool calls, finish reason and token times."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from contracts.errors import UpstreamError
from router.edge.sse import RelayResponse
from router.record.trace import RequestTrace

RID = "chatcmpl-0123456789abcdef"


def _chunk(rid: str, delta: dict, finish: str | None = None) -> bytes:
    return json.dumps(
        {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        },
        separators=(",", ":"),
    ).encode()


USAGE = json.dumps(
    {
        "id": RID,
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
).encode()


async def _batches(batches: list[list[bytes]]) -> AsyncIterator[list[bytes]]:
    for b in batches:
        yield b


async def _run(
    batches: list[list[bytes]], include_usage: bool, *, fail: bool = False
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

    response = RelayResponse(source(), trace, include_usage, lambda st, e: finished.append((st, e)))
    await response.stream_response(send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert sent[-1]["more_body"] is False and all(m["more_body"] for m in sent[1:-1])
    assert len(finished) == 1  # reported once, whatever happened
    return b"".join(m["body"] for m in sent[1:]), trace, finished


def _events(out: bytes) -> list[bytes]:
    assert out.endswith(b"data: [DONE]\n\n")
    return [e[len(b"data: ") :] for e in out.split(b"\n\n") if e]


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
    out, trace, _ = await _run(
        [
            [_chunk("chatcmpl-engine-own-id", {"tool_calls": [call]})],
            [_chunk("chatcmpl-engine-own-id", {"tool_calls": [more]}, "tool_calls")],
        ],
        include_usage=False,
    )
    events = [json.loads(e) for e in _events(out)[:-1]]
    assert [e["id"] for e in events] == [RID, RID]
    assert trace.tool_calls == {0: {"id": "call_1", "name": "read", "arguments": '{"p":"a.py"}'}}
    assert trace.finish_reason == "tool_calls"


async def test_an_odd_payload_is_forwarded_untraced_and_every_token_keeps_the_time_it_went_out() -> None:
    """Chunks are sent unread and read into the trace at the stream's end, all at once: one payload that
    is not JSON must not cost the others their trace, and each token keeps its own batch's time."""
    a, odd, b = _chunk(RID, {"content": "a"}), b"{not json", _chunk(RID, {"content": "b"}, "stop")
    out, trace, finished = await _run([[a, odd], [b]], include_usage=False)
    assert _events(out) == [a, odd, b, b"[DONE]"]
    assert trace.content == ["a", "b"] and trace.finish_reason == "stop"
    assert len(trace.token_times) == 2 and trace.first_token == trace.token_times[0] <= trace.token_times[1]
    assert finished == [("ok", None)]


async def test_a_long_answer_is_traced_whole_in_order() -> None:
    """Past the chunks a stream keeps unread, they are read into the trace as it goes; none is lost."""
    chunks = [_chunk(RID, {"content": f"t{i} "}) for i in range(600)]
    out, trace, _ = await _run([chunks[i : i + 7] for i in range(0, 600, 7)], include_usage=False)
    assert len(_events(out)) == 601
    assert "".join(trace.content) == "".join(f"t{i} " for i in range(600)) and len(trace.token_times) == 600


async def test_a_stream_that_breaks_after_tokens_ends_with_an_error_event() -> None:
    out, trace, finished = await _run([[_chunk(RID, {"content": "partial"})]], include_usage=False, fail=True)
    events = [e for e in out.split(b"\n\n") if e]
    assert events[0] == b"data: " + _chunk(RID, {"content": "partial"})
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][len(b"data: ") :])
    assert "broke" in error["error"]["message"]
    assert finished[0][0] == "error" and trace.content == ["partial"]


# -- push: a real engine stream over a socket, written from the connection's callback ----------------
class _PacedEngine:
    """A loopback HTTP/1.1 server answering one POST with ``n`` chunked SSE events, one write each,
    each after the test lets it go (``go``); records whether the router closed the connection."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.go = asyncio.Semaphore(0)
        self.closed = asyncio.Event()
        self.sent = 0
        self.progress = asyncio.Condition()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/chat/completions"

    async def wait_sent(self, n: int) -> None:
        async with self.progress:
            await self.progress.wait_for(lambda: self.sent >= n)

    async def _watch(self, reader: asyncio.StreamReader) -> None:
        try:
            await reader.read()  # ends once the router closes the connection (pooling keeps it open)
        except ConnectionError:
            pass  # an abort reads as a reset
        finally:
            self.closed.set()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        watcher = asyncio.create_task(self._watch(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            for i in range(self.n):
                await self.go.acquire()
                data = b"data: " + _chunk(RID, {"content": f"t{i}"}) + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
                async with self.progress:
                    self.sent += 1
                    self.progress.notify_all()
            await self.go.acquire()
            writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            await writer.drain()
            await watcher
        except ConnectionError:
            pass
        finally:
            watcher.cancel()
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


class _Client:
    """The ASGI send side: records bodies; ``hold_at`` makes that body's write wait for ``room``
    (as uvicorn's send waits in FlowControl.drain() while the client reads slowly)."""

    def __init__(self, hold_at: int | None = None) -> None:
        self.bodies: list[bytes] = []
        self.hold_at = hold_at
        self.room = asyncio.Event()
        self.progress = asyncio.Condition()

    async def send(self, message: dict) -> None:
        if message["type"] != "http.response.body":
            return
        if len(self.bodies) == self.hold_at and not self.room.is_set():
            await self.room.wait()
        async with self.progress:
            self.bodies.append(message["body"])
            self.progress.notify_all()

    async def wait_bodies(self, n: int) -> None:
        async with self.progress:
            await self.progress.wait_for(lambda: len(self.bodies) >= n)


async def _relay_over(engine: _PacedEngine) -> tuple[RelayResponse, RequestTrace, list, AsyncExitStack]:
    """A relay over a real upstream stream; the returned stack is what the request's owner
    (router.edge.exchange) closes when the request ends."""
    from router.upstream.node_client import NodeClient

    client = NodeClient(connect_timeout_s=5, request_timeout_s=10)
    url = await engine.start()
    stack = AsyncExitStack()
    stack.push_async_callback(client.aclose)
    stream = await stack.enter_async_context(client.open_stream(url, {"stream": True}, {}))
    trace = RequestTrace(request_id=RID, kind="chat", model="m")
    finished: list = []
    return RelayResponse(stream, trace, False, lambda st, e: finished.append((st, e))), trace, finished, stack


async def test_pushed_chunks_keep_their_order_while_a_slow_client_holds_a_write() -> None:
    """The server holds the third write (the client reads slowly) while the engine's later chunks
    arrive: reading from the engine pauses, nothing is lost or reordered, and the stream ends with
    [DONE] once the client drains."""
    engine, client = _PacedEngine(8), _Client(hold_at=2)
    relay, trace, finished, stack = await _relay_over(engine)
    task = asyncio.create_task(relay.stream_response(client.send))
    for _ in range(engine.n + 1):
        engine.go.release()
    await asyncio.wait_for(engine.wait_sent(4), 10)  # chunks behind the held write reached the router
    await asyncio.wait_for(client.wait_bodies(2), 10)
    assert relay._draining is not None and not task.done() and len(client.bodies) == 2
    client.room.set()
    await asyncio.wait_for(task, 10)
    assert _events(b"".join(client.bodies))[:-1] == [_chunk(RID, {"content": f"t{i}"}) for i in range(8)]
    assert trace.content == [f"t{i}" for i in range(8)] and finished == [("ok", None)]
    await stack.aclose()
    await engine.stop()


async def test_a_client_gone_mid_push_stops_writing_and_its_owner_closes_the_engine_connection() -> None:
    engine, client = _PacedEngine(100), _Client()
    relay, trace, finished, stack = await _relay_over(engine)
    task = asyncio.create_task(relay.stream_response(client.send))
    for _ in range(3):
        engine.go.release()
    await asyncio.wait_for(client.wait_bodies(3), 10)
    task.cancel()  # what Starlette does when the client disconnects
    with pytest.raises(asyncio.CancelledError):
        await task
    engine.go.release()  # a chunk arriving now is no longer written anywhere
    assert finished == [("cancelled", None)] and trace.content == ["t0", "t1", "t2"]
    await stack.aclose()  # what the exchange's exit does
    await asyncio.wait_for(engine.closed.wait(), 5)  # the engine saw its request's connection go
    assert len(client.bodies) == 3
    await engine.stop()
