"""Framing for the Responses API over WebSocket (``GET /v1/responses`` upgrade).

OpenAI's WebSocket mode carries the same typed Responses events as SSE, one JSON object per text
message, in both directions. The client sends ``{"type": "response.create", ...}`` (the body of a
``POST /v1/responses`` with the ``type`` key added; ``stream`` is implied) or
``{"type": "response.cancel"}``. One response is in flight per socket: a second ``response.create``
is answered with an ``error`` event and the socket stays open. This module only classifies client
messages and builds error events; the generation itself goes through ``router.codecs.intake`` and
``router.codecs.relay`` so there is one encoder for SSE and WebSocket alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_MESSAGE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Create:
    """A ``response.create``: ``body`` is the Responses request body, ``stream`` forced on."""

    body: dict[str, Any]


@dataclass(frozen=True)
class Cancel:
    """A ``response.cancel``: stop the response in flight, if any."""


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


def parse_client_message(text: str | bytes) -> Create | Cancel | Bad:
    """Classify one client message; never raises on bad input."""
    if len(text) > MAX_MESSAGE_BYTES:
        return Bad(error_event("message_too_large", f"a message may be at most {MAX_MESSAGE_BYTES} bytes"))
    try:
        obj = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return Bad(error_event("invalid_json", "the message is not valid JSON"))
    if not isinstance(obj, dict):
        return Bad(error_event("invalid_json", "the message must be a JSON object"))
    kind = obj.get("type")
    if kind == "response.cancel":
        return Cancel()
    if kind != "response.create":
        return Bad(error_event("unknown_event", f"unsupported client event type: {kind!r}", "type"))
    body = {k: v for k, v in obj.items() if k != "type"}
    if isinstance(body.get("response"), dict):
        body = dict(body["response"])
    body["stream"] = True
    return Create(body)


def busy_event() -> dict[str, Any]:
    """The answer to a ``response.create`` while another response is in flight on the socket."""
    return error_event("response_in_progress", "a response is already in progress on this socket")
