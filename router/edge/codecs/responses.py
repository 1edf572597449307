"""The OpenAI Responses API codec: request body -> ``InternalRequest``; internal events -> Responses events.

Decoding: ``instructions`` becomes the first system message; ``input`` is text (one user message) or items:
``message`` (roles user / assistant / system; ``developer`` becomes system, since many chat templates reject
it; content as text or ``input_text`` / ``output_text`` parts; assistant items without ``id`` / ``status``,
as Codex replays them, are taken), ``function_call`` (joined to the assistant turn before it),
``function_call_output`` (a tool message), ``reasoning`` (dropped: the engine gets no hidden reasoning back).
Tools are ``function`` tools; a ``namespace`` tool's functions join the list, and tools OpenAI's
servers run (``web_search`` and the like: ``HOSTED_TOOLS``) are left out, as Codex sends both by
default. Images, files and any other item or tool type raise ``RequestError``. ``previous_response_id`` and
``prompt_cache_key`` are kept as session hints; resolving the chain is the router's work, not the codec's.

The stream, as ``ResponsesStreamEncoder`` emits it (every event carries ``sequence_number`` from 0)::

    response.created  response.in_progress
    for each text run:
        response.output_item.added (message)  response.content_part.added (output_text)
        response.output_text.delta*
        response.output_text.done  response.content_part.done  response.output_item.done
    for each tool call:
        response.output_item.added (function_call)  response.function_call_arguments.delta*
        response.function_call_arguments.done  response.output_item.done
    then one of:
        response.completed                    (finish stop / tool_calls)
        response.incomplete                   (finish length: incomplete_details.reason max_output_tokens)
        response.failed                       (an Error: the open items are closed first, status incomplete)

Usage is ``input_tokens`` (with ``input_tokens_details.cached_tokens``), ``output_tokens`` and
``total_tokens``. ``build_response`` gives the same final object for a request that does not stream.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from router.edge.codecs import internal as ir

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
HOSTED_TOOLS = frozenset(
    {"web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview", "image_generation"}
)
"""Tools OpenAI's own servers run; a request that lists them is served without them (Codex lists
``web_search`` by default), as no server here can run them."""
# Error kinds -> ResponseError.code (the SDK's closed list has no capacity code of its own).
_ERROR_CODES = {"capacity": "rate_limit_exceeded", "invalid_request": "invalid_prompt"}


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ir.RequestError(f"{where}.content must be a string or a list of parts", where)
    texts: list[str] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise ir.RequestError(
                f"{where}.content[{i}]: part type {kind!r} is not supported (text parts only; the model has no vision)",
                f"{where}.content[{i}].type",
            )
    return "".join(texts)


def _decode_input(items: Any) -> list[ir.Message]:
    if isinstance(items, str):
        return [ir.Message("user", items)]
    if not isinstance(items, list):
        raise ir.RequestError("input must be a string or a list of items", "input")
    out: list[ir.Message] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise ir.RequestError(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role", ""))
            if role is None:
                raise ir.RequestError(
                    f"{where}.role {item.get('role')!r} is not one of {sorted(_ROLES)}", f"{where}.role"
                )
            out.append(ir.Message(role, _content_text(item.get("content", ""), where)))  # type: ignore[arg-type]
        elif kind == "function_call":
            if not item.get("call_id") or not item.get("name"):
                raise ir.RequestError(f"{where}: a function_call needs call_id and name", where)
            call = ir.ToolCall(str(item["call_id"]), str(item["name"]), str(item.get("arguments") or ""))
            if out and out[-1].role == "assistant":
                last = out.pop()
                out.append(ir.Message("assistant", last.text, (*last.tool_calls, call)))
            else:
                out.append(ir.Message("assistant", "", (call,)))
        elif kind == "function_call_output":
            if not item.get("call_id"):
                raise ir.RequestError(f"{where}: a function_call_output needs call_id", f"{where}.call_id")
            output = item.get("output", "")
            text = output if isinstance(output, str) else _content_text(output, where)
            out.append(ir.Message("tool", text, tool_call_id=str(item["call_id"])))
        elif kind == "reasoning":
            continue
        else:
            raise ir.RequestError(f"{where}: input item type {kind!r} is not supported", f"{where}.type")
    return out


def _decode_tools(tools: Any) -> tuple[ir.Tool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ir.RequestError("tools must be a list", "tools")
    out: list[ir.Tool] = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, Mapping) else None
        if kind in HOSTED_TOOLS:
            continue  # a tool OpenAI's servers run (Codex sends web_search): nothing here runs it
        if kind == "namespace" and isinstance(t, Mapping) and isinstance(t.get("tools"), list):
            out.extend(_decode_tools(t["tools"]))  # a named group of function tools (Codex's sub-agent tools)
            continue
        if not isinstance(t, Mapping) or kind != "function" or not t.get("name"):
            raise ir.RequestError(f"tools[{i}]: only named function tools are supported, not {kind!r}", f"tools[{i}]")
        out.append(
            ir.Tool(str(t["name"]), str(t.get("description") or ""), ir.engine_safe(dict(t.get("parameters") or {})))
        )
    return tuple(out)


def _decode_tool_choice(choice: Any) -> ir.ToolChoice | None:
    if choice is None:
        return None
    if choice in ("auto", "none", "required"):
        return ir.ToolChoice(choice)
    if isinstance(choice, Mapping) and choice.get("type") == "function" and choice.get("name"):
        return ir.ToolChoice("function", str(choice["name"]))
    raise ir.RequestError("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")


def decode_request(body: Any, headers: Mapping[str, str] | None = None) -> ir.InternalRequest:
    """A Responses API request body (parsed JSON) as the internal request; ``RequestError`` on bad input."""
    if not isinstance(body, Mapping):
        raise ir.RequestError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ir.RequestError("model is required", "model")
    messages: list[ir.Message] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise ir.RequestError("instructions must be a string", "instructions")
        messages.append(ir.Message("system", instructions))
    messages.extend(_decode_input(body.get("input", [])))
    if not messages:  # only reasoning items (or empty instructions): an empty turn, as an empty string is
        messages.append(ir.Message("user", ""))
    max_tokens = ir.number_field(body, "max_output_tokens", int)
    if max_tokens is not None and max_tokens < 1:
        raise ir.RequestError("max_output_tokens must be at least 1", "max_output_tokens")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise ir.RequestError("metadata must be an object of strings", "metadata")
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise ir.RequestError("truncation must be auto or disabled", "truncation")
    prev = body.get("previous_response_id")
    return ir.InternalRequest(
        api="responses",
        model=model,
        messages=tuple(messages),
        tools=(tools := _decode_tools(body.get("tools"))),
        tool_choice=ir.checked_tool_choice(tools, _decode_tool_choice(body.get("tool_choice"))),
        parallel_tool_calls=body.get("parallel_tool_calls"),
        temperature=ir.number_field(body, "temperature", float),
        top_p=ir.number_field(body, "top_p", float),
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        store=body.get("store"),
        metadata={str(k): str(v) for k, v in metadata.items()},
        hints=ir.hints_from_headers(
            headers or {},
            previous_response_id=str(prev) if prev else None,
            prompt_cache_key=body.get("prompt_cache_key") or None,
            user=body.get("user") or None,
        ),
    )


def error_body(err: ir.RequestError) -> dict[str, Any]:
    """The OpenAI error shape for a request the codec refused (HTTP 400)."""
    return {"error": {"message": err.message, "type": "invalid_request_error", "param": err.param, "code": None}}


# -- the response object and the stream ----------------------------------------------------------------


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _usage(u: ir.Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        # cache_write_tokens: the engine caches every prefix it computes on its own; no explicit writes are made.
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call: ir.ToolCall, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


class ResponsesStreamEncoder:
    """Internal events -> Responses stream events (dicts), in the order the module docstring gives."""

    def __init__(self, req: ir.InternalRequest, response_id: str | None = None, created_at: int | None = None) -> None:
        self._req = req
        self.response_id = response_id or new_response_id()
        self._created_at = created_at if created_at is not None else int(time.time())
        self._seq = 0
        self._output: list[dict[str, Any]] = []  # finished items
        self._text: tuple[str, list[str]] | None = None  # open message: (item id, deltas)
        self._call: tuple[str, str, str, list[str]] | None = None  # open call: (item id, call id, name, deltas)
        self._usage: ir.Usage | None = None
        self._items = 0
        self.finished = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def _item_id(self, prefix: str) -> str:
        self._items += 1
        return f"{prefix}_{self.response_id.removeprefix('resp_')}_{self._items}"

    def response(self, status: str, error: ir.Error | None = None, incomplete: str | None = None) -> dict[str, Any]:
        req = self._req
        choice: Any = "auto"
        if req.tool_choice is not None:
            choice = (
                {"type": "function", "name": req.tool_choice.name}
                if req.tool_choice.mode == "function"
                else req.tool_choice.mode
            )
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self._created_at,
            "status": status,
            "model": req.model,
            "output": list(self._output),
            "instructions": None,
            "error": None
            if error is None
            else {"code": _ERROR_CODES.get(error.kind, "server_error"), "message": error.message},
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "metadata": dict(req.metadata),
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "tool_choice": choice,
            "tools": [
                {
                    "type": "function",
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                    "strict": False,
                }
                for t in req.tools
            ],
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_output_tokens": req.max_tokens,
            "previous_response_id": req.hints.previous_response_id,
            "store": req.store if req.store is not None else True,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": None if self._usage is None else _usage(self._usage),
        }

    def start(self) -> list[dict[str, Any]]:
        r = self.response("in_progress")
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _close_text(self, status: str) -> list[dict[str, Any]]:
        if self._text is None:
            return []
        item_id, deltas = self._text
        self._text = None
        text = "".join(deltas)
        index = len(self._output)
        item = _message_item(item_id, text, status)
        self._output.append(item)
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=_text_part(text)),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _close_call(self, status: str) -> list[dict[str, Any]]:
        if self._call is None:
            return []
        item_id, call_id, name, deltas = self._call
        self._call = None
        index = len(self._output)
        item = _call_item(item_id, ir.ToolCall(call_id, name, "".join(deltas)), status)
        self._output.append(item)
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                name=name,
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def feed(self, ev: ir.Event) -> list[dict[str, Any]]:
        if self.finished:
            return []
        index = len(self._output)
        if isinstance(ev, ir.TextDelta):
            out = self._close_call("completed")
            index = len(self._output)
            if self._text is None:
                item_id = self._item_id("msg")
                self._text = (item_id, [])
                where = {"item_id": item_id, "output_index": index, "content_index": 0}
                out += [
                    self._event(
                        "response.output_item.added",
                        output_index=index,
                        item=_message_item(item_id, None, "in_progress"),
                    ),
                    self._event("response.content_part.added", **where, part=_text_part("")),
                ]
            self._text[1].append(ev.text)
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._text[0],
                    output_index=index,
                    content_index=0,
                    delta=ev.text,
                    logprobs=[],
                )
            )
            return out
        if isinstance(ev, ir.ToolCallStart):
            out = self._close_text("completed") + self._close_call("completed")
            item_id = self._item_id("fc")
            self._call = (item_id, ev.id, ev.name, [])
            item = _call_item(item_id, ir.ToolCall(ev.id, ev.name, ""), "in_progress")
            return [*out, self._event("response.output_item.added", output_index=len(self._output), item=item)]
        if isinstance(ev, ir.ToolCallArgsDelta):
            if self._call is None:
                return []
            self._call[3].append(ev.delta)
            return [
                self._event(
                    "response.function_call_arguments.delta", item_id=self._call[0], output_index=index, delta=ev.delta
                )
            ]
        if isinstance(ev, ir.ToolCallEnd):
            return self._close_call("completed")
        if isinstance(ev, ir.Usage):
            self._usage = ev
            return []
        self.finished = True
        if isinstance(ev, ir.Finish):
            if ev.reason == "length":
                out = self._close_text("incomplete") + self._close_call("incomplete")
                return [
                    *out,
                    self._event(
                        "response.incomplete", response=self.response("incomplete", incomplete="max_output_tokens")
                    ),
                ]
            out = self._close_text("completed") + self._close_call("completed")
            return [*out, self._event("response.completed", response=self.response("completed"))]
        out = self._close_text("incomplete") + self._close_call("incomplete")
        return [*out, self._event("response.failed", response=self.response("failed", error=ev))]


def build_response(
    req: ir.InternalRequest, done: ir.Completion, response_id: str | None = None, created_at: int | None = None
) -> dict[str, Any]:
    """The Response object for a request that did not stream, from the gathered completion."""
    enc = ResponsesStreamEncoder(req, response_id, created_at)
    last: dict[str, Any] = {}
    for item in done.output:
        if isinstance(item, str):
            enc.feed(ir.TextDelta(item))
        else:
            enc.feed(ir.ToolCallStart(0, item.id, item.name))
            enc.feed(ir.ToolCallArgsDelta(0, item.arguments))
            enc.feed(ir.ToolCallEnd(0))
    enc.feed(done.usage)
    terminal: ir.Event = done.error or done.finish or ir.Error("upstream", "the engine's answer has no finish reason")
    for ev in enc.feed(terminal):
        last = ev
    return last["response"]


def sse(event: Mapping[str, Any]) -> bytes:
    """One Responses event as an SSE frame (``event:`` names the type, as OpenAI sends it)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
