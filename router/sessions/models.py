"""What a session is made of: turns of OpenAI-shaped messages, tool calls, tool results and usage.

A *turn* is one request/response exchange. It stores the messages the turn *added* (the new user
message, or the ``tool`` messages carrying tool results) and the assistant's ``response`` (text and/or
``tool_calls``), so the whole conversation is ``for turn: turn.messages + [turn.response]``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from contracts.errors import InvalidRequest

SESSION_HEADER = "x-session-id"
_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class FunctionCall(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    arguments: str = ""
    """JSON text, exactly as the model produced it (possibly invalid JSON: stored verbatim)."""


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    function: FunctionCall
    type: str = "function"
    """Always written out: OpenAI requires it on the tool calls of an assistant message sent back."""


class Message(msgspec.Struct, frozen=True, omit_defaults=True):
    """An OpenAI chat message. ``content`` is text, or the list of content parts as the client sent it."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    """On ``role="tool"`` messages: which call this is the result of."""


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0


class Turn(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    turn_id: str
    """Unique within the session; the idempotency key (the router uses its request id)."""
    session_id: str
    tenant_id: str
    created_at: float
    """Unix seconds when the turn ended; orders the turns of a session (ties by turn_id)."""
    messages: list[Message]
    response: Message | None = None
    usage: Usage | None = None
    model: str | None = None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self.response.tool_calls or []) if self.response else []

    @property
    def tool_results(self) -> list[Message]:
        return [m for m in self.messages if m.role == "tool"]

    def conversation(self) -> list[Message]:
        return [*self.messages, *([self.response] if self.response else [])]


def validate_id(value: str, what: str) -> str:
    if not _ID.match(value):
        raise InvalidRequest(f"{what} must be 1-128 characters of [A-Za-z0-9._:-], got {value!r}", param=what)
    return value


def new_session_id() -> str:
    return f"sess-{uuid.uuid4().hex}"


def conversation(turns: Sequence[Turn]) -> list[Message]:
    """The whole conversation of a session, in order."""
    return [m for t in turns for m in t.conversation()]


def new_messages(history: Sequence[Message], request_messages: Sequence[Message]) -> list[Message]:
    """What a full-history request adds to the stored history (the usual agent case): the tail after
    the stored conversation when the request starts with it; otherwise the client rewrote its history
    (trimmed, summarised) and the whole request is the turn's input."""
    n = len(history)
    if n and len(request_messages) >= n and list(request_messages[:n]) == list(history):
        return list(request_messages[n:])
    return list(request_messages)
