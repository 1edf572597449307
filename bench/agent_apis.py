"""One agent turn in each API's own shape, and a streaming client that times it: what ``tandem bench
agents`` sends through Chat Completions, Responses and Messages.

A turn of ``bench.agent_workload`` is a chat message list whose assistant replies end in
``Calling tool("arg").`` and whose next user message is ``Output of tool:\\n…``. ``structure`` turns it
into the items a coding agent really sends: the assistant's text and a tool call, then that call's
result, under one call id; each encoder writes them as its API does:

    API         endpoint                 system          tool call                 tool result
    chat        /v1/chat/completions     system message  assistant ``tool_calls``  ``tool`` message
    responses   /v1/responses            instructions    ``function_call`` item    ``function_call_output``
    messages    /v1/messages             ``system``      ``tool_use`` block        ``tool_result`` block

Every request also carries the workload's tool list (JSON schemas), ``temperature: 0``, a cap on the
output and the session in the header its client sends (chat ``x-session-id``, Codex's ``session-id``,
Claude Code's ``x-claude-code-session-id``). The stream readers time each text delta (TTFT, ITL) and
read each API's usage into prompt and cached tokens (Messages counts cache reads and writes apart from
``input_tokens``; the others count them inside).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from bench.agent_workload import TOOLS
from bench.loadgen import RequestResult, StreamRefused, TokenClock, data_events

APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
SESSION_HEADERS = {"chat": "x-session-id", "responses": "session-id", "messages": "x-claude-code-session-id"}
_CALL = re.compile(r'\nCalling (\w+)\("([^"]*)"\)\.$')
_OUTPUT = re.compile(r"^Output of (\w+):\n", re.S)


@dataclass(frozen=True)
class Item:
    """One piece of a structured history: ``kind`` user, assistant, call or result."""

    kind: str
    text: str = ""
    call_id: str = ""
    tool: str = ""


def structure(messages: list[dict[str, str]]) -> tuple[str, list[Item]]:
    """(system prompt, items) of one workload turn; a scripted tool call and its output become a call
    and a result sharing one id."""
    system, items, pending = "", [], ""
    for i, m in enumerate(messages):
        role, text = m["role"], m["content"]
        if role == "system":
            system = text
        elif role == "assistant" and (call := _CALL.search(text)):
            pending = f"call_{i}"
            items += [
                Item("assistant", text[: call.start()]),
                Item("call", json.dumps({"arg": call[2]}), pending, call[1]),
            ]
        elif role == "user" and pending and (out := _OUTPUT.match(text)):
            items.append(Item("result", text[out.end() :], pending, out[1]))
            pending = ""
        else:
            items.append(Item(role, text))
    return system, items


def _schema(tool: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"arg": {"type": "string", "description": f"What {tool} acts on."}}}


def chat_body(model: str, system: str, items: list[Item], max_tokens: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for it in items:
        if it.kind == "call":
            call = {"id": it.call_id, "type": "function", "function": {"name": it.tool, "arguments": it.text}}
            messages[-1]["tool_calls"] = [call]
        elif it.kind == "result":
            messages.append({"role": "tool", "tool_call_id": it.call_id, "content": it.text})
        else:
            messages.append({"role": it.kind, "content": it.text})
    tools = [{"type": "function", "function": {"name": t, "description": t, "parameters": _schema(t)}} for t in TOOLS]
    return {
        "model": model,
        "messages": messages,
        "tools": tools,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def responses_body(model: str, system: str, items: list[Item], max_tokens: int) -> dict[str, Any]:
    inputs: list[dict[str, Any]] = []
    for it in items:
        if it.kind == "call":
            inputs.append({"type": "function_call", "call_id": it.call_id, "name": it.tool, "arguments": it.text})
        elif it.kind == "result":
            inputs.append({"type": "function_call_output", "call_id": it.call_id, "output": it.text})
        else:
            kind = "input_text" if it.kind == "user" else "output_text"
            inputs.append({"type": "message", "role": it.kind, "content": [{"type": kind, "text": it.text}]})
    tools = [{"type": "function", "name": t, "description": t, "parameters": _schema(t)} for t in TOOLS]
    return {
        "model": model,
        "instructions": system,
        "input": inputs,
        "tools": tools,
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "store": False,
        "stream": True,
    }


def messages_body(model: str, system: str, items: list[Item], max_tokens: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for it in items:
        if it.kind == "call":
            block = {"type": "tool_use", "id": it.call_id, "name": it.tool, "input": json.loads(it.text)}
        elif it.kind == "result":
            block = {"type": "tool_result", "tool_use_id": it.call_id, "content": it.text}
        else:
            block = {"type": "text", "text": it.text}
        role = "assistant" if it.kind in ("assistant", "call") else "user"
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].append(block)
        else:
            messages.append({"role": role, "content": [block]})
    tools = [{"name": t, "description": t, "input_schema": _schema(t)} for t in TOOLS]
    return {
        "model": model,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": messages,
        "tools": tools,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


BODIES: dict[str, Callable[[str, str, list[Item], int], dict[str, Any]]] = {
    "chat": chat_body,
    "responses": responses_body,
    "messages": messages_body,
}


# -- reading each API's stream ---------------------------------------------------------------------------
@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


def read_event(api: str, event: dict[str, Any], usage: Usage) -> tuple[bool, str | None]:
    """(whether ``event`` carries answer text, its error message if it is an error) for one SSE data
    object of ``api``; usage found in it is written into ``usage``."""
    if api == "chat":
        if "error" in event:
            return False, str(event["error"])[:200]
        if u := event.get("usage"):
            details = u.get("prompt_tokens_details") or {}
            usage.prompt_tokens, usage.output_tokens = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
            usage.cached_tokens = details.get("cached_tokens") or 0
        return any((c.get("delta") or {}).get("content") for c in event.get("choices") or []), None
    kind = event.get("type", "")
    if api == "responses":
        if kind in ("error", "response.failed"):
            return False, str(event.get("response", {}).get("error") or event.get("message") or kind)[:200]
        # incomplete: the answer reached max_output_tokens, as most of the bench's answers do
        if kind in ("response.completed", "response.incomplete") and (u := event["response"].get("usage")):
            usage.prompt_tokens, usage.output_tokens = u.get("input_tokens", 0), u.get("output_tokens", 0)
            usage.cached_tokens = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
        return kind == "response.output_text.delta" and bool(event.get("delta")), None
    if kind == "error":
        return False, str(event.get("error"))[:200]
    if kind in ("message_start", "message_delta"):
        _anthropic_usage((event.get("message") or {}).get("usage") or event.get("usage") or {}, usage)
    delta = event.get("delta") or {}
    return kind == "content_block_delta" and delta.get("type") == "text_delta" and bool(delta.get("text")), None


def _anthropic_usage(u: dict[str, Any], usage: Usage) -> None:
    """Messages' usage, in ``message_start`` and again, final, in ``message_delta`` (where a server may
    send only ``output_tokens``): the prompt is ``input_tokens`` plus cache reads and writes."""
    read, written = u.get("cache_read_input_tokens") or 0, u.get("cache_creation_input_tokens") or 0
    prompt = (u.get("input_tokens") or 0) + read + written
    if prompt:
        usage.prompt_tokens, usage.cached_tokens = prompt, read
    usage.output_tokens = u.get("output_tokens") or usage.output_tokens


async def one_turn(
    client: httpx.AsyncClient,
    api: str,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    ids: list[str] | None = None,
) -> RequestResult:
    """Send one streamed turn and time it as the client sees it; a Responses answer's id goes to ``ids``."""
    clock = TokenClock()
    usage = Usage()
    try:
        async with contextlib.aclosing(data_events(client, url, body, headers)) as events:
            async for event in events:
                text, error = read_event(api, event, usage)
                if error is not None:
                    return RequestResult(ok=False, error=error)
                if ids is not None and event.get("type") in ("response.completed", "response.incomplete"):
                    ids.append(event["response"]["id"])
                if text:
                    clock.tick()
    except StreamRefused as exc:
        return RequestResult(ok=False, error=str(exc))
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}")
    return answered(clock, usage)


def answered(clock: TokenClock, usage: Usage) -> RequestResult:
    """A turn read to its end: its timing as the client saw it and its usage; a failure without text."""
    if clock.first is None:
        return RequestResult(ok=False, error="no text received")
    return RequestResult(
        ok=True,
        ttft_s=clock.first - clock.start,
        e2e_s=time.perf_counter() - clock.start,
        itl_s=clock.itl,
        output_tokens=usage.output_tokens,
        prompt_tokens=usage.prompt_tokens,
        usage={"prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens},
    )
