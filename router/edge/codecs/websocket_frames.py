"""What a client may send on a WebSocket (``router.edge.codecs.websocket``), classified; and the error events.

Responses (OpenAI's WebSocket mode): ``{"type": "response.create", ...}`` (the body of a
``POST /v1/responses`` with the ``type`` key added, or nested under ``response``; ``stream`` is implied)
or ``{"type": "response.cancel"}``. A ``response.create`` with ``"generate": false`` is a prewarm (``Prewarm``:
Codex sends one as each socket opens, ``request_kind: prewarm`` in its metadata, and gives up on a socket whose
prewarm does not complete in time). Chat Completions: a chat request body per message (``type``, if
present, ``chat.completion.create``; ``stream`` implied), or ``{"type": "cancel"}``. Anything else is
answered with an ``error`` event and the socket stays open. A message is parsed under the same limits
as an HTTP body (``router.edge.limits.parse_json``: size, nesting, container count), so one message cannot
hold the event loop any longer than a request can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from contracts.errors import InvalidRequest
from router.edge.limits import parse_json

MAX_MESSAGE_BYTES = 10 * 1024 * 1024
"""The default bound on one message (the router's ``max_body_bytes`` is passed in practice)."""
_CREATE = {"responses": "response.create", "chat": "chat.completion.create"}
_CANCEL = {"response.cancel", "cancel"}


@dataclass(frozen=True)
class Create:
    """A request to answer: ``body`` is the HTTP route's request body, ``stream`` forced on."""

    body: dict[str, Any]


@dataclass(frozen=True)
class Prewarm:
    """A ``response.create`` that asks for no output (``"generate": false``): answered as a completed,
    empty response, with no engine work; ``body`` is its request body (its input is the next turn's
    history: Codex chains its first turn on the prewarm's id)."""

    body: dict[str, Any]


@dataclass(frozen=True)
class Cancel:
    """Stop the response in flight, if any."""


@dataclass(frozen=True)
class Bad:
    """A message that is not a valid client event: answer ``event``, keep the socket."""

    event: dict[str, Any]


def error_event(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """An ``error`` event in the shape the Responses stream uses."""
    return {
        "type": "error",
        "error": {"type": "invalid_request_error", "code": code, "message": message, "param": param},
    }


def parse_client_message(
    text: str | bytes,
    api: Literal["responses", "chat"] = "responses",
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_depth: int = 64,
    max_containers: int = 200_000,
) -> Create | Prewarm | Cancel | Bad:
    """Classify one client message; never raises on bad input."""
    raw = text.encode() if isinstance(text, str) else text
    if len(raw) > max_bytes:
        return Bad(error_event("message_too_large", f"a message may be at most {max_bytes} bytes"))
    try:
        obj = parse_json(raw, max_depth, max_containers)
    except InvalidRequest as exc:
        code = exc.code if exc.code and exc.code != "invalid_request_error" else "invalid_json"
        return Bad(error_event(code, exc.message))
    if not isinstance(obj, dict):
        return Bad(error_event("invalid_json", "the message must be a JSON object"))
    kind = obj.get("type")
    if kind in _CANCEL:
        return Cancel()
    if kind != _CREATE[api] and not (api == "chat" and kind is None):
        return Bad(error_event("unknown_event", f"unsupported client event type: {kind!r}", "type"))
    body = {k: v for k, v in obj.items() if k != "type"}
    if api == "responses" and isinstance(body.get("response"), dict):
        body = dict(body["response"])
    if api == "responses" and body.get("generate") is False:
        return Prewarm({k: v for k, v in body.items() if k != "generate"})
    body["stream"] = True
    return Create(body)


def busy_event() -> dict[str, Any]:
    """The answer to a ``response.create`` while another response is in flight on the socket."""
    return error_event("response_in_progress", "a response is already in progress on this socket")
