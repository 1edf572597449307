"""Relaying the decode node's stream to the client as OpenAI SSE.

Chunks keep the engine's shape and bytes; the usage chunk is forwarded only when the client asked for
it (the router always asks the engine, for its own accounting); ``[DONE]`` ends a good stream; a
failure after the status line is reported in-band as an ``error`` event followed by ``[DONE]``, as
OpenAI does.

Per-chunk cost is what bounds a router's throughput (issue 11: every token of the fleet crosses it),
so a chunk that passes unchanged is never re-encoded:

- The router sends the engine ``X-Request-Id`` so that the engine's chunk ``id`` already is the
  router's response id (``router.planning.legs.Legs._headers``). Should an engine still use another id, the id is
  replaced in the bytes (its first occurrence, which is the ``id`` field).
- Each payload is decoded once into a narrow typed view (``_Chunk``: text, tool-call deltas, finish
  reason, usage), which msgspec does in about a microsecond; the trace takes what the records need.
- Only the usage chunk is decoded whole and re-encoded: it gets the hit-rate breakdown
  (``record_usage``), and is dropped when the client did not ask for usage.
- What one upstream read brought goes to the client in one write, straight to uvicorn's transport
  while the client reads (``router.edge.direct_write``), through ASGI ``send`` otherwise.

Push, not pull: for a stream from an engine (``router.upstream.sse_upstream.SseStream``) the relay sends the
first batch itself and then attaches: each later batch is rewritten and written to the client from
the upstream connection's own callback, with no task wake-up per chunk. The ASGI ``send`` is driven by
hand; it completes at once unless the server holds the write because the client reads slowly. Then
reading from the engine pauses, a task finishes that send and any batches already parsed, and reading
resumes: a slow client slows its own engine stream and never makes the router buffer without bound.
A client that takes nothing for ``send_timeout_s`` (``TANDEM_ROUTER_CLIENT_SEND_TIMEOUT_S``) has its
stream cut (``ClientStalled``, recorded, never sent): otherwise it would hold its node slot forever.
Other sources (tests) are pulled with ``async for``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from contracts.errors import ClientStalled, TandemError
from router.edge.direct_write import DirectWriter, direct_writer
from router.edge.disconnect import DisconnectWatch
from router.edge.openai_errors import error_from_exception
from router.record.trace import RequestTrace, record_usage
from router.upstream.sse_upstream import SseStream

log = logging.getLogger("tandem.router.sse")
_encode = msgspec.json.Encoder().encode


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    """The fields of a chunk the router reads; everything else passes through in the bytes."""

    id: str = ""
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: dict[str, Any] | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


OnFinish = Callable[[str, TandemError | None], None]
"""Called once when the stream ends: (status, error)."""


class _Relay:
    """Per-stream state: the trace to fill, and how payloads are rewritten for the client."""

    __slots__ = ("trace", "include_usage", "rid")
    complete = False
    """Chat and completions end with ``[DONE]``, written with the end of the body."""

    def __init__(self, trace: RequestTrace, include_usage: bool) -> None:
        self.trace = trace
        self.include_usage = include_usage
        self.rid = trace.request_id.encode()

    def batch(self, payloads: list[bytes]) -> bytes:
        """The bytes to send for one batch of upstream payloads (possibly empty)."""
        out: list[bytes] = []
        trace = self.trace
        now = 0.0
        for payload in payloads:
            try:
                chunk = _decode_chunk(payload)
            except msgspec.DecodeError:
                # Not ours to judge: forward it as the engine sent it (an SSE comment-like oddity).
                out.append(b"data: " + payload + b"\n\n")
                continue
            if chunk.usage is not None:
                if not chunk.choices:
                    whole = msgspec.json.decode(payload)
                    record_usage(trace, whole["usage"])
                    if self.include_usage:
                        whole["id"] = trace.request_id
                        out.append(sse_event(whole))
                    continue
                if not self.include_usage:  # continuous usage the client did not ask for
                    whole = msgspec.json.decode(payload)
                    whole.pop("usage", None)
                    whole["id"] = trace.request_id
                    payload = _encode(whole)
            token = False
            for choice in chunk.choices:
                if choice.finish_reason:
                    trace.finish_reason = choice.finish_reason
                delta = choice.delta
                if delta is not None:
                    if delta.content:
                        trace.content.append(delta.content)
                    if delta.tool_calls:
                        for call in delta.tool_calls:
                            trace.add_tool_call_delta(call)
                    token = token or bool(delta.content or delta.tool_calls or delta.reasoning_content)
                elif choice.text:
                    trace.content.append(choice.text)
                    token = True
            if token:
                now = now or time.time()
                trace.first_token = trace.first_token or now
                trace.token_times.append(now)
            if chunk.id and chunk.id != trace.request_id:
                payload = payload.replace(chunk.id.encode(), self.rid, 1)
            out.append(b"data: " + payload + b"\n\n")
        return b"".join(out)

    def end(self, error: TandemError | None) -> bytes:
        """The stream's last bytes: ``[DONE]``, after an ``error`` event if it failed."""
        return _DONE if error is None else sse_event(error_from_exception(error)) + _DONE


class BatchEncoder(Protocol):
    """What the relay writes for each batch of engine payloads and at the end: ``_Relay`` for chat and
    completions, an edge API's encoder (``router.edge.codecs.relay.CodecRelay``) for Responses and Messages."""

    complete: bool
    """Whether what ``batch`` has encoded already ends the answer in the API's terms (Responses'
    ``response.completed``, Messages' ``message_stop``): a client may leave once it has read that."""

    def batch(self, payloads: list[bytes]) -> bytes: ...
    def end(self, error: TandemError | None) -> bytes: ...


_DONE = b"data: [DONE]\n\n"


class RelayResponse(StreamingResponse):
    """The client's SSE response: relays the decode node's batches (see the module docstring).

    A StreamingResponse whose body loop is the relay itself rather than an async generator it iterates:
    one generator layer less on every chunk, and ``[DONE]`` goes out with the end of the body in one
    write. A client that disconnects cancels the body loop through the request's ``DisconnectWatch``
    (``router.edge.disconnect``: the exchange's, or one of the response's own), not through Starlette's
    task group of two tasks per response; whatever way the stream ends, ``finally`` reports once
    through ``on_finish``, and the request's owner (``router.edge.exchange``) then closes the upstream stream.
    """

    def __init__(
        self,
        batches: SseStream | AsyncIterator[list[bytes]],
        trace: RequestTrace,
        include_usage: bool,
        on_finish: OnFinish,
        headers: dict[str, str] | None = None,
        send_timeout_s: float | None = None,
        watch: DisconnectWatch | None = None,
        encoder: BatchEncoder | None = None,
    ) -> None:
        self.batches = batches
        self.watch = watch
        """Disarmed just before the last write (after it, uvicorn reports every receive as a disconnect)."""
        self.send_timeout_s = send_timeout_s
        """Longest one write may wait on a client that does not read (None: no bound)."""
        self.state: BatchEncoder = encoder or _Relay(trace, include_usage)
        self.trace = trace
        self.on_finish = on_finish
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.init_headers(headers)
        self._send: Send | None = None
        self._source: SseStream | None = None
        self._draining: asyncio.Future[None] | None = None
        self._backlog: list[list[bytes]] = []
        self._scope: Scope | None = None
        self._direct: DirectWriter | None = None
        """Body chunks straight to uvicorn's transport (``router.edge.direct_write``), once the start is sent."""
        self._delivered = False
        """A write that carried the API's end of the answer went out (``BatchEncoder.complete``): a client
        that leaves after it got its whole answer (Codex CLI closes on ``response.completed``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope = scope
        own = self.watch is None
        watch = self.watch = self.watch or DisconnectWatch(receive)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not (own and watch.absorb()):
                raise  # not ours (the exchange's watch, or a shutdown): the owner decides
        finally:
            if own:
                watch.close()

    async def stream_response(self, send: Send) -> None:
        status, error = "ok", None
        state = self.state
        source = self.batches
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if self._scope is not None:
                self._direct = direct_writer(self._scope)
            try:
                if isinstance(source, SseStream):
                    await self._push(source, send)
                else:
                    async for payloads in source:
                        await self._bounded(self._write(send, payloads))
                end = state.end(None)
            except ClientStalled as exc:
                # It reads nothing, so no error event could reach it: end here, without the final write
                # (uvicorn then closes the connection); ``finally`` records why.
                status, error = "error", exc
                log.warning("%s: %s", self.trace.request_id, exc.message)
                return
            except TandemError as exc:
                # As OpenAI ends a stream that fails after its status line: an error event, then [DONE],
                # so a client's SSE loop ends normally instead of on a cut connection.
                status, error = "error", exc
                end = state.end(exc)
            if self.watch is not None:
                self.watch.disarm()
            try:
                await self._bounded(send({"type": "http.response.body", "body": end, "more_body": False}))
            except ClientStalled as exc:  # everything went out but the end, which it does not take
                status, error = "error", exc
                log.warning("%s: %s", self.trace.request_id, exc.message)
        except (asyncio.CancelledError, GeneratorExit):
            status = "ok" if self._delivered else "cancelled"
            raise
        except OSError:  # the client's connection went away under a write
            status = "ok" if self._delivered else "cancelled"
            raise
        finally:
            if isinstance(source, SseStream):
                source.detach()
            if self._draining is not None:
                self._draining.cancel()
            # The owner of the request (router.edge.exchange) closes the upstream stream, which aborts the
            # engine's request if it is still running.
            self.trace.finish = time.time()
            self.on_finish(status, error)

    # -- push (see the module docstring) ------------------------------------------------------------
    async def _write(self, send: Send, batch: list[bytes]) -> None:
        data = self.state.batch(batch)
        if data and not (self._direct is not None and self._direct.write(data)):
            await send(_body(data))
        self._delivered = self.state.complete

    async def _push(self, source: SseStream, send: Send) -> None:
        self._send, self._source = send, source
        while batch := source.take():  # what arrived before attaching goes out first
            await self._write(send, batch)
        source.attach(self._on_batch)  # no await since the empty take: nothing arrived in between
        await source.finished()
        if self._draining is not None:
            await self._draining

    def _on_batch(self, batch: list[bytes]) -> None:
        """Called by the upstream connection with each parsed batch; writes it to the client now."""
        if self._draining is not None:  # an earlier write waits on the client: keep the order
            self._backlog.append(batch)
            return
        data = self.state.batch(batch)
        if not data or (self._direct is not None and self._direct.write(data)):
            self._delivered = self.state.complete
            return  # written (the common case: the client reads)
        assert self._send is not None and self._source is not None
        pending = self._send(_body(data))
        try:
            blocker = pending.send(None)
        except StopIteration:
            self._delivered = self.state.complete
            return  # written (the common case: the server had room)
        self._source.pause()
        self._draining = asyncio.ensure_future(self._finish_send(self._source, self._send, pending, blocker))

    async def _finish_send(
        self, source: SseStream, send: Send, pending: Coroutine[Any, Any, None], blocker: Any
    ) -> None:
        """Run a send that suspended (the server's flow control) to its end, then the backlog; then
        read from the engine again."""
        deadline = None if self.send_timeout_s is None else time.monotonic() + self.send_timeout_s
        try:
            await self._complete(pending, blocker, deadline)
            self._delivered = self.state.complete  # the backlog is encoded as it is written
            while self._backlog:
                await self._bounded(self._write(send, self._backlog.pop(0)), deadline)
        except asyncio.CancelledError:
            pending.close()
            raise
        except Exception as exc:  # the write failed: the relay's wait on the stream raises it
            pending.close()
            source.fail(exc)
            return
        finally:
            self._draining = None
        source.resume()

    def _stalled(self) -> ClientStalled:
        return ClientStalled(f"the client read nothing for {self.send_timeout_s:g} s; stream cut")

    @staticmethod
    def _time_left(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    async def _complete(self, pending: Coroutine[Any, Any, None], blocker: Any, deadline: float | None) -> None:
        """Drive a send that suspended on ``blocker`` to its end, as a Task would, within ``deadline``."""
        while True:
            if isinstance(blocker, asyncio.Future):
                blocker._asyncio_future_blocking = False  # as a Task does with what a coroutine yields
                # Without taking its result: the send reads it below.
                done, _ = await asyncio.wait([blocker], timeout=self._time_left(deadline))
                if not done:
                    raise self._stalled()
            else:  # a bare yield
                await asyncio.sleep(0)
            try:
                blocker = pending.send(None)
            except StopIteration:
                return

    async def _bounded(self, write: Coroutine[Any, Any, None], deadline: float | None = None) -> None:
        """One write, within the send timeout (from ``deadline`` when given, else from now). Driven by
        hand: a write the server takes at once (the common case) costs no task and no timer."""
        try:
            blocker = write.send(None)
        except StopIteration:
            return
        if deadline is None and self.send_timeout_s is not None:
            deadline = time.monotonic() + self.send_timeout_s
        try:
            await self._complete(write, blocker, deadline)
        except BaseException:
            write.close()
            raise


def _body(data: bytes) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": True}
