"""The Anthropic Messages codec: request body -> ``InternalRequest``; internal events -> Messages events.

Decoding: ``system`` as text or text blocks becomes the first system message (a ``system`` message
among the others, beta ``mid-conversation-system``, stays where it is), with Claude Code's
``x-anthropic-billing-header`` line taken out (it carries a nonce that changes on every request; left in,
every prefix would miss the cache from the first token). Message content is text or blocks: ``text``,
``tool_use`` (an assistant tool call; ``input`` becomes JSON arguments), ``tool_result`` (a tool message,
text or text blocks, ``is_error`` kept); ``thinking`` / ``redacted_thinking`` blocks are dropped; an
``image`` or ``document`` block raises ``RequestError`` (the model has no vision). ``tools`` carry
``input_schema``; ``tool_choice`` auto / any (-> required) / tool (-> that function) / none;
``stop_sequences``, ``max_tokens`` (required), ``temperature``, ``top_p``, ``top_k``; ``metadata.user_id``
becomes the user hint; ``thinking`` and ``cache_control`` are accepted and ignored here.

The stream, as ``MessagesStreamEncoder`` emits it (``index`` counts content blocks from 0)::

    message_start                      (usage: input_tokens as known at the start, output_tokens 0)
    for each text run or tool call:
        content_block_start            (text "" | tool_use {id, name, input {}})
        content_block_delta*           (text_delta | input_json_delta)
        content_block_stop
    message_delta                      (stop_reason end_turn | max_tokens | tool_use | stop_sequence; usage)
    message_stop
  ping                                 (``ping()``: a keep-alive the edge may send between any two events)
  or, on an Error at any point (open blocks are not closed, as Anthropic's own stream does):
    error                              {"type": "error", "error": {"type": ..., "message": ...}}

Usage tells the prefix cache's truth: ``input_tokens`` are the prompt tokens the engine computed,
``cache_read_input_tokens`` the tokens it found cached (on the decode node, after a P/D transfer, or in
the host tier), ``cache_creation_input_tokens`` 0 (no explicit breakpoint writes are made), so the three
add up to the prompt as Anthropic's do. ``build_message`` gives the same message for a request that does
not stream.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from router.edge.codecs.internal import (
    Completion,
    Error,
    Event,
    Finish,
    InternalRequest,
    Message,
    RequestError,
    TextDelta,
    Tool,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolChoice,
    Usage,
    arguments_object,
    checked_tool_choice,
    engine_safe,
    hints_from_headers,
    number_field,
)

BILLING_HEADER = "x-anthropic-billing-header"
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
# Internal error kinds -> Anthropic error types (capacity is overloaded_error, answered with 529 by the edge).
ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "capacity": "overloaded_error",
    "timeout": "timeout_error",
    "upstream": "api_error",
    "internal": "api_error",
}


def strip_billing_header(text: str) -> str:
    """``text`` without Claude Code's per-request billing line."""
    if BILLING_HEADER not in text:
        return text
    kept = [line for line in text.split("\n") if not line.lstrip().startswith(BILLING_HEADER)]
    return "\n".join(kept).strip("\n")


def _blocks_text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise RequestError(f"{where} must be a string or a list of text blocks", where)
    texts: list[str] = []
    for i, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, Mapping) else None
        if kind != "text":
            _refuse_block(kind, f"{where}[{i}]")
        texts.append(str(b.get("text", "")))
    return "\n".join(texts)


def _refuse_block(kind: Any, where: str) -> None:
    if kind in ("image", "document"):
        raise RequestError(f"{where}: {kind} blocks are not supported: the model has no vision", where)
    raise RequestError(f"{where}: content block type {kind!r} is not supported here", where)


def _decode_message(i: int, m: Any) -> list[Message]:
    where = f"messages.{i}"
    if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant", "system"):
        raise RequestError(f"{where}: role must be user, assistant or system", f"{where}.role")
    role = m["role"]
    content = m.get("content", "")
    if role == "system":  # a mid-conversation system message (Claude Code's agents and skills, by default)
        return [Message("system", _blocks_text(content, f"{where}.content"))]
    if isinstance(content, str):
        return [Message(role, content)]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of blocks", f"{where}.content")
    out: list[Message] = []
    texts: list[str] = []
    calls: list[ToolCall] = []

    def flush_user_text() -> None:
        if texts:
            out.append(Message("user", "".join(texts)))
            texts.clear()

    for j, b in enumerate(content):
        bw = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, Mapping) else None
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            if not b.get("id") or not b.get("name"):
                raise RequestError(f"{bw}: a tool_use block needs id and name", bw)
            calls.append(ToolCall(str(b["id"]), str(b["name"]), json.dumps(b.get("input") or {})))
        elif kind == "tool_result" and role == "user":
            if not b.get("tool_use_id"):
                raise RequestError(f"{bw}: a tool_result block needs tool_use_id", f"{bw}.tool_use_id")
            flush_user_text()
            text = _blocks_text(b.get("content", ""), f"{bw}.content")
            out.append(Message("tool", text, tool_call_id=str(b["tool_use_id"]), is_error=bool(b.get("is_error"))))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            _refuse_block(kind, bw)
    if role == "assistant":
        return [Message("assistant", "".join(texts), tuple(calls))]
    flush_user_text()
    return out or [Message("user", "")]  # an empty list of blocks is an empty turn, as an empty string is


def _decode_tools(tools: Any) -> tuple[Tool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or t.get("type", "custom") != "custom" or not t.get("name"):
            kind = t.get("type") if isinstance(t, Mapping) else None
            raise RequestError(
                f"tools.{i}: only custom tools with a name and input_schema are supported, not {kind!r}", f"tools.{i}"
            )
        out.append(
            Tool(str(t["name"]), str(t.get("description") or ""), engine_safe(dict(t.get("input_schema") or {})))
        )
    return tuple(out)


def _decode_tool_choice(choice: Any) -> tuple[ToolChoice | None, bool | None]:
    if choice is None:
        return None, None
    if not isinstance(choice, Mapping):
        raise RequestError("tool_choice must be an object", "tool_choice")
    kind = choice.get("type")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    if kind == "auto":
        return ToolChoice("auto"), parallel
    if kind == "any":
        return ToolChoice("required"), parallel
    if kind == "none":
        return ToolChoice("none"), parallel
    if kind == "tool" and choice.get("name"):
        return ToolChoice("function", str(choice["name"])), parallel
    raise RequestError("tool_choice.type must be auto, any, tool (with name) or none", "tool_choice.type")


MAX_STOP_SEQUENCES = 4
"""The engine's limit (vLLM's chat request: at most 4 stop strings); more is the client's 400 here."""


def decode_request(body: Any, headers: Mapping[str, str] | None = None) -> InternalRequest:
    """An Anthropic Messages request body (parsed JSON) as the internal request; ``RequestError`` on bad input."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model: field required", "model")
    max_tokens = number_field(body, "max_tokens", int)
    if max_tokens is None or max_tokens < 1:
        raise RequestError("max_tokens: field required, at least 1", "max_tokens")
    messages: list[Message] = []
    system = body.get("system")
    if system:
        text = strip_billing_header(_blocks_text(system, "system"))
        if text:
            messages.append(Message("system", text))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages: at least one message is required", "messages")
    for i, m in enumerate(raw):
        messages.extend(_decode_message(i, m))
    stops = body.get("stop_sequences") or []
    # Never an empty one: it would stop at once (the engine refuses it: "stop cannot contain an empty string").
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop_sequences: must be a list of non-empty strings", "stop_sequences")
    if len(stops) > MAX_STOP_SEQUENCES:  # what the engine takes: it refuses more
        raise RequestError(f"stop_sequences: at most {MAX_STOP_SEQUENCES}", "stop_sequences")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise RequestError("metadata: must be an object", "metadata")
    choice, parallel = _decode_tool_choice(body.get("tool_choice"))
    user = metadata.get("user_id")
    return InternalRequest(
        api="messages",
        model=model,
        messages=tuple(messages),
        tools=(tools := _decode_tools(body.get("tools"))),
        tool_choice=checked_tool_choice(tools, choice),
        parallel_tool_calls=parallel,
        temperature=number_field(body, "temperature", float),
        top_p=number_field(body, "top_p", float),
        top_k=number_field(body, "top_k", int),
        max_tokens=max_tokens,
        stop=tuple(stops),
        stream=bool(body.get("stream", False)),
        hints=hints_from_headers(headers or {}, user=str(user) if user else None),
    )


def error_body(kind: str, message: str) -> dict[str, Any]:
    """Anthropic's error shape; ``kind`` is an internal ``ErrorKind``."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(kind, "api_error"), "message": message}}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _usage(u: Usage) -> dict[str, int]:
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": u.completion_tokens,
    }


def _stop(f: Finish) -> tuple[str, str | None]:
    if f.reason == "stop" and f.stop_sequence is not None:
        return "stop_sequence", f.stop_sequence
    return _STOP_REASONS[f.reason], None


class MessagesStreamEncoder:
    """Internal events -> Anthropic Messages stream events (dicts), in the order the module docstring gives."""

    def __init__(self, req: InternalRequest, message_id: str | None = None) -> None:
        self._req = req
        self.message_id = message_id or new_message_id()
        self._index = -1
        self._open = False
        self._text = False  # the open block is a text block
        self._usage = Usage(0, 0, 0)
        self._called = False
        self.finished = False

    def start(self, prompt_tokens: int = 0, cached_tokens: int = 0) -> list[dict[str, Any]]:
        """``message_start``; the router passes the prompt tokens it counted, where it has them."""
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self._req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(Usage(prompt_tokens, cached_tokens, 0)),
        }
        return [{"type": "message_start", "message": message}]

    @staticmethod
    def ping() -> dict[str, Any]:
        """A keep-alive event, as Anthropic sends while a turn is slow to start."""
        return {"type": "ping"}

    def _close(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": self._index}]

    def _begin(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self._index += 1
        self._open = True
        return [*out, {"type": "content_block_start", "index": self._index, "content_block": block}]

    def feed(self, ev: Event) -> list[dict[str, Any]]:
        if self.finished:
            return []
        if isinstance(ev, TextDelta):
            out = [] if self._open and self._text else self._begin({"type": "text", "text": ""})
            self._text = True
            delta = {"type": "text_delta", "text": ev.text}
            return [*out, {"type": "content_block_delta", "index": self._index, "delta": delta}]
        if isinstance(ev, ToolCallStart):
            self._text = False
            self._called = True
            return self._begin({"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        if isinstance(ev, ToolCallArgsDelta):
            delta = {"type": "input_json_delta", "partial_json": ev.delta}
            return [{"type": "content_block_delta", "index": self._index, "delta": delta}]
        if isinstance(ev, ToolCallEnd):
            self._text = False
            return self._close()
        if isinstance(ev, Usage):
            self._usage = ev
            return []
        self.finished = True
        if isinstance(ev, Finish):
            reason, sequence = _stop(ev)
            if self._called and reason == "end_turn":
                reason = "tool_use"  # the engine ends a forced (named) tool call with "stop"
            return [
                *self._close(),
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": _usage(self._usage),
                },
                {"type": "message_stop"},
            ]
        assert isinstance(ev, Error)
        return [error_body(ev.kind, ev.message)]


def build_message(req: InternalRequest, done: Completion, message_id: str | None = None) -> dict[str, Any]:
    """The Message object for a request that did not stream; an errored completion gives the error body."""
    if done.error is not None:
        return error_body(done.error.kind, done.error.message)
    if done.finish is None:
        return error_body("upstream", "the engine's answer has no finish reason")
    content: list[dict[str, Any]] = []
    for item in done.output:
        if isinstance(item, str):
            content.append({"type": "text", "text": item})
        else:
            content.append(
                {"type": "tool_use", "id": item.id, "name": item.name, "input": arguments_object(item.arguments)}
            )
    reason, sequence = _stop(done.finish)
    if reason == "end_turn" and any(not isinstance(x, str) for x in done.output):
        reason = "tool_use"  # the engine ends a forced (named) tool call with "stop"
    return {
        "id": message_id or new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(done.usage),
    }


def sse(event: Mapping[str, Any]) -> bytes:
    """One Messages event as an SSE frame (``event:`` names the type, as Anthropic sends it)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
