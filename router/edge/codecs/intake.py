"""The edge of the Responses and Messages routes: their body becomes the chat request the cluster plans.

``decode`` runs the API's codec (``RequestError`` -> 400 in the API's shape), resolves
``previous_response_id`` from the tenant's stored responses (its conversation is prepended, and the
chain's session is the request's), and picks the session key from what the client sent, first found::

    x-session-id  >  the previous response's session  >  X-Claude-Code-Session-Id / Codex's session-id,
    session_id    >  Codex's thread-id / conversation-id  >  prompt_cache_key

The chat body it returns is ``to_chat_body`` of the internal request, validated as any chat request, so
every later step (edge limits, tokenizing, routing, admission, the record) is the chat path's own.
``error_response`` answers a refused request in the API's error shape (Messages: ``overloaded_error``
with 529 where chat says 503).
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from pydantic import ValidationError

from contracts.errors import InvalidRequest, RateLimited, TandemError, Unavailable, ValidationFailed
from router.edge.codecs import messages as messages_codec
from router.edge.codecs import responses as responses_codec
from router.edge.codecs.internal import Api, InternalRequest, RequestError, to_chat_body
from router.edge.codecs.openapi import COUNT_TOKENS_REQUEST, MESSAGES_REQUEST, RESPONSES_REQUEST
from router.edge.codecs.store import ResponseStore
from router.edge.openai_errors import response_for
from router.edge.schemas import ChatCompletionRequest

_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass
class Intake:
    internal: InternalRequest
    chat: ChatCompletionRequest
    session_id: str | None
    response_id: str
    history: int
    """How many of ``internal.messages`` came from ``previous_response_id``."""


def _session_key(value: object) -> str | None:
    if not value or not isinstance(value, str):
        return None
    value = value.strip()
    return value if _SESSION_ID.fullmatch(value) else f"h-{uuid.uuid5(uuid.NAMESPACE_URL, value).hex}"


_VALIDATORS = {
    "responses": Draft202012Validator(RESPONSES_REQUEST),
    "messages": Draft202012Validator(MESSAGES_REQUEST),
    "count_tokens": Draft202012Validator(COUNT_TOKENS_REQUEST),
}


def check_schema(which: str, body: Any) -> None:
    """The body against the route's documented request schema (``router.edge.codecs.openapi``): a field of the
    wrong type is a 400 naming it, as the document promises, not a guess."""
    error = best_match(_VALIDATORS[which].iter_errors(body))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or None
        raise InvalidRequest(f"{where or 'body'}: {error.message[:200]}", param=where)


def decode_body(api: Api, body: Any, headers: Mapping[str, str]) -> InternalRequest:
    """The API's codec over ``body``; whatever it cannot take is a 400."""
    try:
        return (responses_codec if api == "responses" else messages_codec).decode_request(body, headers)
    except RequestError as exc:
        raise InvalidRequest(exc.message, param=exc.param) from exc
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        # A field of the wrong shape deep in the body (a codec reads what well-formed clients send).
        raise InvalidRequest(f"the request body does not match the {api} API: {exc}") from exc


async def decode(
    api: Api, body: Any, headers: Mapping[str, str], store: ResponseStore, tenant_id: str | None
) -> Intake:
    check_schema(api, body)
    internal = decode_body(api, body, headers)
    hints = internal.hints
    history = 0
    chain_session = None
    if hints.previous_response_id:
        prev = await store.load(tenant_id, hints.previous_response_id, param="previous_response_id")
        history = len(prev.messages)
        chain_session = prev.session_id
        internal = _with_messages(internal, (*prev.messages, *internal.messages))
    response_id = responses_codec.new_response_id() if api == "responses" else messages_codec.new_message_id()
    session_id = next(
        (
            s
            for s in (
                _session_key(headers.get("x-session-id")),
                chain_session,
                _session_key(hints.session_id),
                _session_key(hints.conversation_id),
                _session_key(hints.prompt_cache_key),
            )
            if s
        ),
        None,
    )
    try:
        chat = ChatCompletionRequest.model_validate(to_chat_body(internal))
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise ValidationFailed(f"{loc or 'body'}: {first.get('msg')}", param=loc or None) from exc
    return Intake(internal, chat, session_id, response_id, history)


def _with_messages(req: InternalRequest, messages: tuple[Any, ...]) -> InternalRequest:
    import msgspec

    return msgspec.structs.replace(req, messages=messages)


_ANTHROPIC_STATUS = {503: 529}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_response(api: Api, exc: TandemError) -> JSONResponse:
    """A refused request in the API's own error shape."""
    if api != "messages":
        return response_for(exc)
    headers = {}
    if isinstance(exc, RateLimited | Unavailable):
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after)))
    body = {
        "type": "error",
        "error": {"type": _ANTHROPIC_TYPES.get(exc.status_code, "api_error"), "message": exc.message},
    }
    return JSONResponse(body, status_code=_ANTHROPIC_STATUS.get(exc.status_code, exc.status_code), headers=headers)
