"""The one internal request every edge API is decoded into, and the internal stream events.

A request from any API (Chat Completions, Responses, Anthropic Messages) becomes an ``InternalRequest``:
messages with the roles system / user / assistant / tool carrying text, tool calls and tool results; the
function tools; the tool choice; sampling; the output cap; stop strings; whether it streams; and the
session hints the client sent (its session headers, ``previous_response_id``, ``prompt_cache_key``). The
``api`` field names the API it came from, so the lake and the metrics can say which.

The engine is always called with Chat Completions: ``to_chat_body`` renders the request as that body, and
``ChatChunkReader`` turns the engine's chunk dicts into events, in this order::

    (TextDelta | ToolCallStart ToolCallArgsDelta* ToolCallEnd)*  Usage?  Finish
    ... Error                       (at any point; nothing follows an Error)

The reader holds the finish reason back until the usage chunk (which vLLM sends after it) or the end of the
stream, so every encoder sees ``Usage`` before ``Finish`` and can put the usage into its terminal event. A
stream that ends without a finish reason ends with an ``Error``, never with a short "successful" stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import msgspec

Api = Literal["chat", "responses", "messages"]
Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]
ErrorKind = Literal["invalid_request", "capacity", "timeout", "upstream", "internal"]


class RequestError(ValueError):
    """A request body an edge codec cannot take; the edge answers it in its API's own error shape (400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: str  # JSON text, as the engine and the OpenAI APIs carry it


class Message(msgspec.Struct, frozen=True):
    role: Role
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # role "tool": the call this message answers
    is_error: bool = False  # role "tool": the tool reported a failure (Anthropic's tool_result.is_error)


class Tool(msgspec.Struct, frozen=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolChoice(msgspec.Struct, frozen=True):
    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None  # mode "function": the one tool the model must call


def engine_safe(value: Any) -> Any:
    """``value`` (parsed JSON) with every integer outside what msgpack carries (-2**63 .. 2**64-1) as a
    float. A tool's schema reaches the engine core inside the request's sampling parameters when a call
    is forced (guided decoding), and vLLM answered such a schema with a bare 500 (found by schemathesis
    against a real engine); as a JSON Schema number the float bounds the same value."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return float(value) if not -(2**63) <= value < 2**64 else value
    if isinstance(value, dict):
        return {k: engine_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [engine_safe(v) for v in value]
    return value


def checked_tool_choice(tools: tuple[Tool, ...], choice: ToolChoice | None) -> ToolChoice | None:
    """``choice`` if ``tools`` can satisfy it, else ``RequestError``: a tool must be called (``required``,
    Anthropic's ``any``) only when there are tools, and a named one must be among them (OpenAI and
    Anthropic refuse the same; the engine would, with a 400 in its own words). ``auto`` and ``none``
    without tools ask nothing, and the engine never sees them (``to_chat_body``)."""
    if choice is None or choice.mode in ("auto", "none"):
        return choice
    if not tools:
        raise RequestError("tool_choice asks for a tool call but no tools are given", "tool_choice")
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        raise RequestError(f"tool_choice names `{choice.name}`, which is not among the tools", "tool_choice")
    return choice


class SessionHints(msgspec.Struct, frozen=True):
    """What the client said about its session; the router turns these into the session key later."""

    session_id: str | None = None
    conversation_id: str | None = None
    agent_id: str | None = None
    parent_agent_id: str | None = None
    prompt_cache_key: str | None = None
    previous_response_id: str | None = None
    user: str | None = None


class InternalRequest(msgspec.Struct, frozen=True):
    api: Api
    model: str
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    hints: SessionHints = msgspec.field(default_factory=SessionHints)


# The session headers the agent clients send: Claude Code's, and Codex's (``session-id``, older ``session_id``,
# ``thread-id``). Header names are matched lower-case.
_SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "session_id", "x-session-id")
_CONVERSATION_HEADERS = ("thread-id", "conversation-id", "conversation_id")


MAX_INT = 2**31 - 1
"""The largest integer a sampling field may carry: the engine keeps them in 32-bit tensors, and a JSON
integer past that (schema-valid: JSON has no bound) reached vLLM and failed there as a 500."""


def number_field(body: Mapping[str, Any], key: str, kind: type) -> Any:
    """``body[key]`` as a number of ``kind`` (int or float), None when absent; ``RequestError`` otherwise."""
    value = body.get(key)
    if value is None:
        return None
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON's integers include 3.0 (JSON Schema's do; pydantic takes them too)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(f"{key} must be a {kind.__name__}", key)
    if kind is int and not -MAX_INT <= value <= MAX_INT:
        raise RequestError(f"{key} must be between {-MAX_INT} and {MAX_INT}", key)
    return value


def hints_from_headers(headers: Mapping[str, str], **fields: str | None) -> SessionHints:
    """Session hints from the client's headers, plus the body's own hints passed as keywords."""
    low = {k.lower(): v for k, v in headers.items()}

    def first(names: Iterable[str]) -> str | None:
        return next((low[n] for n in names if low.get(n)), None)

    return SessionHints(
        session_id=first(_SESSION_HEADERS),
        conversation_id=first(_CONVERSATION_HEADERS),
        agent_id=low.get("x-claude-code-agent-id") or None,
        parent_agent_id=low.get("x-claude-code-parent-agent-id") or None,
        **fields,
    )


# -- internal stream events -------------------------------------------------------------------------------


class TextDelta(msgspec.Struct, frozen=True, tag=True):
    text: str


class ToolCallStart(msgspec.Struct, frozen=True, tag=True):
    index: int
    id: str
    name: str


class ToolCallArgsDelta(msgspec.Struct, frozen=True, tag=True):
    index: int
    delta: str


class ToolCallEnd(msgspec.Struct, frozen=True, tag=True):
    index: int


class Usage(msgspec.Struct, frozen=True, tag=True):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Finish(msgspec.Struct, frozen=True, tag=True):
    reason: FinishReason
    stop_sequence: str | None = None  # the stop string that ended it, where the engine says which


class Error(msgspec.Struct, frozen=True, tag=True):
    kind: ErrorKind
    message: str


Event = TextDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | Usage | Finish | Error


# -- to the engine --------------------------------------------------------------------------------------


def _chat_message(m: Message) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "tool", "tool_call_id": m.tool_call_id, "content": m.text}
    if m.role == "assistant" and m.tool_calls:
        return {
            "role": "assistant",
            "content": m.text or None,
            "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ],
        }
    return {"role": m.role, "content": m.text}


def to_chat_body(req: InternalRequest) -> dict[str, Any]:
    """The engine's Chat Completions body for ``req``.

    Consecutive system messages are joined into one (Responses' ``instructions`` plus ``developer`` items,
    Anthropic's system blocks): many chat templates accept one system message only.
    """
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        if m.role == "system" and messages and messages[-1]["role"] == "system":
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{m.text}"
            continue
        messages.append(_chat_message(m))
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in req.tools
        ]
    if req.tool_choice is not None and req.tools:
        if req.tool_choice.mode == "function":
            body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
        else:
            body["tool_choice"] = req.tool_choice.mode
    if req.parallel_tool_calls is not None and req.tools:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    for key in ("temperature", "top_p", "top_k", "max_tokens"):
        value = getattr(req, key)
        if value is not None:
            body[key] = value
    if req.stop:
        body["stop"] = list(req.stop)
    return body


# -- from the engine ------------------------------------------------------------------------------------

_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
}


class ChatChunkReader:
    """Reads the engine's Chat Completions chunks (parsed JSON dicts) into internal events.

    ``feed`` one chunk at a time, then ``close`` when the stream ends (``[DONE]`` or EOF).
    """

    def __init__(self) -> None:
        self._open: dict[int, bool] = {}  # engine tool-call index -> started
        self._finish: Finish | None = None
        self._usage_seen = False
        self._done = False

    def _close_tools(self) -> list[Event]:
        events: list[Event] = [ToolCallEnd(i) for i in sorted(self._open)]
        self._open.clear()
        return events

    def feed(self, chunk: Mapping[str, Any]) -> list[Event]:
        if self._done:
            return []
        if "error" in chunk:
            err = chunk["error"] if isinstance(chunk["error"], Mapping) else {"message": str(chunk["error"])}
            self._done = True
            return [Error("upstream", str(err.get("message") or "engine error"))]
        events: list[Event] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self._open:
                    events.extend(self._close_tools())
                events.append(TextDelta(delta["content"]))
            for call in delta.get("tool_calls") or ():
                index = int(call.get("index", 0))
                fn = call.get("function") or {}
                if index not in self._open:
                    # A new call closes the earlier ones: the engine streams calls one after another.
                    events.extend(self._close_tools())
                    self._open[index] = True
                    events.append(ToolCallStart(index, call.get("id") or f"call_{index}", fn.get("name") or ""))
                if fn.get("arguments"):
                    events.append(ToolCallArgsDelta(index, fn["arguments"]))
            reason = choice.get("finish_reason")
            if reason:
                events.extend(self._close_tools())
                stop = choice.get("stop_reason")
                self._finish = Finish(_FINISH.get(reason, "stop"), stop if isinstance(stop, str) else None)
        usage = chunk.get("usage")
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            events.append(
                Usage(
                    int(usage.get("prompt_tokens") or 0),
                    int(details.get("cached_tokens") or 0),
                    int(usage.get("completion_tokens") or 0),
                )
            )
            self._usage_seen = True
            if self._finish is not None:
                events.append(self._finish)
                self._done = True
        return events

    def close(self) -> list[Event]:
        """The events the end of the stream releases: the held finish, or an Error where none came."""
        if self._done:
            return []
        self._done = True
        if self._finish is None:
            return [*self._close_tools(), Error("upstream", "the engine's stream ended without a finish reason")]
        return [self._finish]


# -- a whole completion, for the non-stream builders ----------------------------------------------------


class Completion(msgspec.Struct):
    """A finished stream gathered: the output in order (text runs and tool calls), usage, finish, error."""

    output: list[str | ToolCall] = msgspec.field(default_factory=list)
    usage: Usage = msgspec.field(default_factory=lambda: Usage(0, 0, 0))
    finish: Finish | None = None
    error: Error | None = None


def collect(events: Iterable[Event]) -> Completion:
    done = Completion()
    calls: dict[int, list[str]] = {}  # index -> [id, name, args...]
    for ev in events:
        if isinstance(ev, TextDelta):
            if done.output and isinstance(done.output[-1], str):
                done.output[-1] += ev.text
            else:
                done.output.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            calls[ev.index] = [ev.id, ev.name]
        elif isinstance(ev, ToolCallArgsDelta):
            calls[ev.index].append(ev.delta)
        elif isinstance(ev, ToolCallEnd):
            cid, name, *args = calls.pop(ev.index)
            done.output.append(ToolCall(cid, name, "".join(args)))
        elif isinstance(ev, Usage):
            done.usage = ev
        elif isinstance(ev, Finish):
            done.finish = ev
        elif isinstance(ev, Error):
            done.error = ev
    return done


def arguments_object(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as an object (Anthropic's ``input``); ``{}`` for empty text."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        # The model wrote arguments that are not JSON: keep them visible rather than fail the whole answer.
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}
