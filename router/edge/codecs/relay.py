"""The seam between the cluster's one chat path and the edge APIs: engine chat chunks in, an API's events out.

Every API goes through the same exchange (admit, plan, route, record, cancel); only the edge differs. The
SSE relay (``router.edge.sse.RelayResponse``) takes a batch encoder; for Chat Completions it is the relay's own
pass-through, for Responses and Messages it is a ``CodecRelay``: each engine payload is read once into
the request's trace (content, tool calls, token times, usage with the hit breakdown, as for chat) and
into internal events (``ChatChunkReader``), which the API's stream encoder turns into its own events::

    first batch:  the API's opening events (response.created / message_start)
    each batch:   the encoded events of its chunks
    end:          the held finish (or an Error), encoded: response.completed / message_stop ...

A request that does not stream gets the engine's chat answer turned into the same events by
``completion_from_chat`` and the API's non-stream builder. ``done`` is the gathered output, for the
Responses store (``previous_response_id`` chains).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import msgspec

from contracts.errors import TandemError
from router.edge.codecs import messages as messages_codec
from router.edge.codecs import responses as responses_codec
from router.edge.codecs.internal import (
    ChatChunkReader,
    Completion,
    Error,
    ErrorKind,
    Event,
    Finish,
    InternalRequest,
    Message,
    TextDelta,
    ToolCall,
    Usage,
    collect,
)
from router.record.trace import RequestTrace, record_usage

_decode = msgspec.json.decode
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_ANSWERED = frozenset({"response.completed", "response.incomplete", "message_stop"})
"""The events after which the client holds its whole answer (it may close the stream there)."""


class StreamEncoder(Protocol):
    def start(self) -> list[dict[str, Any]]: ...
    def feed(self, ev: Event) -> list[dict[str, Any]]: ...


class _MessagesStart:
    """The Messages encoder with the router's prompt count in ``message_start`` (where it has one)."""

    def __init__(self, enc: messages_codec.MessagesStreamEncoder, trace: RequestTrace) -> None:
        self.enc, self.trace = enc, trace

    def start(self) -> list[dict[str, Any]]:
        return [*self.enc.start(self.trace.prompt_tokens or 0), self.enc.ping()]

    def feed(self, ev: Event) -> list[dict[str, Any]]:
        return self.enc.feed(ev)


def error_kind(exc: TandemError) -> ErrorKind:
    if exc.status_code == 503 or exc.status_code == 429:
        return "capacity"
    if exc.status_code == 504:
        return "timeout"
    if exc.status_code < 500:
        return "invalid_request"
    return "upstream"


class CodecRelay:
    """``batch(payloads) -> bytes`` and ``end(error) -> bytes`` for one stream of an edge API."""

    def __init__(self, trace: RequestTrace, encoder: StreamEncoder, frame: Callable[[Mapping[str, Any]], bytes]):
        self.trace = trace
        self.encoder = encoder
        self.frame = frame
        self.reader = ChatChunkReader()
        self.events: list[Event] = []
        self.started = False
        self.complete = False
        """An answered end (``_ANSWERED``) is encoded: ``router.edge.sse.BatchEncoder.complete``."""
        self._final: dict[str, Any] | None = None

    def _encode(self, events: list[Event]) -> bytes:
        out: list[bytes] = []
        if not self.started:
            self.started = True
            out.extend(self.frame(e) for e in self.encoder.start())
        for ev in events:
            self.events.append(ev)
            for e in self.encoder.feed(ev):
                kind = e.get("type")
                if kind in _TERMINAL:
                    self._final = e["response"]
                self.complete = self.complete or kind in _ANSWERED
                out.append(self.frame(e))
        return b"".join(out)

    def batch(self, payloads: list[bytes]) -> bytes:
        trace = self.trace
        events: list[Event] = []
        for payload in payloads:
            try:
                chunk = _decode(payload)
            except msgspec.DecodeError:
                continue
            if not isinstance(chunk, dict):
                continue
            _observe(trace, chunk)
            events.extend(self.reader.feed(chunk))
        return self._encode(events)

    def end(self, error: TandemError | None) -> bytes:
        if error is not None:
            self.reader.close()
            return self._encode([Error(error_kind(error), error.message)])
        return self._encode(self.reader.close())

    def final(self) -> dict[str, Any] | None:
        """The Response object of the terminal event (Responses only), once the stream has ended."""
        return self._final

    def done(self) -> Completion:
        return collect(self.events)


def _observe(trace: RequestTrace, chunk: dict[str, Any]) -> None:
    """What the chat relay records of a chunk, for the lake and the metrics."""
    usage = chunk.get("usage")
    if usage and not chunk.get("choices"):
        record_usage(trace, usage)
    token = False
    for choice in chunk.get("choices") or ():
        if choice.get("finish_reason"):
            trace.finish_reason = choice["finish_reason"]
        delta = choice.get("delta") or {}
        if delta.get("content"):
            trace.content.append(delta["content"])
        for call in delta.get("tool_calls") or ():
            trace.add_tool_call_delta(call)
        token = token or bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))
    if token:
        now = time.time()
        trace.first_token = trace.first_token or now
        trace.token_times.append(now)


def completion_from_chat(answer: Mapping[str, Any]) -> Completion:
    """A non-stream chat completion (the engine's answer) as a gathered completion."""
    done = Completion()
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    if message.get("content"):
        done.output.append(message["content"])
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        done.output.append(ToolCall(call.get("id") or "call_0", fn.get("name") or "", fn.get("arguments") or ""))
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    done.usage = Usage(
        int(usage.get("prompt_tokens") or 0),
        int(details.get("cached_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
    )
    reason = choice.get("finish_reason")
    stop = choice.get("stop_reason")
    if reason:
        mapped = {"length": "length", "tool_calls": "tool_calls", "function_call": "tool_calls"}.get(reason, "stop")
        done.finish = Finish(mapped, stop if isinstance(stop, str) else None)  # type: ignore[arg-type]
    else:
        done.error = Error("upstream", "the engine's answer has no finish reason")
    return done


def output_messages(done: Completion) -> list[Message]:
    """The assistant turn a completion adds to the conversation (for ``previous_response_id``)."""
    text = "".join(x for x in done.output if isinstance(x, str))
    calls = tuple(x for x in done.output if isinstance(x, ToolCall))
    return [Message("assistant", text, tool_calls=calls)] if text or calls else []


def stream_encoder(req: InternalRequest, trace: RequestTrace, response_id: str) -> CodecRelay:
    if req.api == "responses":
        return CodecRelay(trace, responses_codec.ResponsesStreamEncoder(req, response_id), responses_codec.sse)
    enc = messages_codec.MessagesStreamEncoder(req, response_id)
    return CodecRelay(trace, _MessagesStart(enc, trace), messages_codec.sse)


def build_answer(req: InternalRequest, done: Completion, response_id: str) -> dict[str, Any]:
    if req.api == "responses":
        return responses_codec.build_response(req, done, response_id)
    return messages_codec.build_message(req, done, response_id)


__all__ = ["CodecRelay", "TextDelta", "build_answer", "completion_from_chat", "output_messages", "stream_encoder"]
