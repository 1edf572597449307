"""What the router checks before it believes a client's request: size, shape, and fields it may not set.

Every check here is O(body size) at most and needs no Redis round trip, so it costs a normal request
microseconds (the router's CPU budget is a few milliseconds per request):

    bytes on the socket ──► BodyLimit (ASGI): Content-Length over the limit → 413 before a byte is read;
                            a chunked body is counted as it arrives and refused (413) at the limit, so
                            the router never holds more than ``max_body_bytes`` of one request
    body bytes ─────────► parse_json: invalid → 400 ``invalid_json``; nested deeper than the C decoder
                            can go (RecursionError) or than ``max_json_depth`` → 400 ``json_too_deep``
    parsed request ─────► check_chat: message count and per-message size (400 ``too_many_messages``,
                            ``message_too_large``); a client ``chat_template`` unless the operator
                            trusts them (400 ``chat_template_not_allowed``, as vLLM's
                            ``--trust-request-chat-template``); ``chat_template_kwargs`` from an
                            allowlist, scalar values only (400 ``chat_template_kwargs_not_allowed``)

Fields the router itself sets for engines (``kv_transfer_params``, ...) are dropped from client input
by the request models (``router.schemas.INTERNAL_FIELDS``), so no client can name a KV source or pin
blocks on a node. Why the limits are where they are: the router tokenizes the prompt itself (context
check, token limits, routing keys), at about 1 s of CPU per MB of text; an unbounded body was 110 s
and 3 GB of RSS for 100 MB.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts.errors import InvalidRequest, PayloadTooLarge
from router.openai_errors import error_from_exception


class BodyLimit:
    """Pure ASGI middleware (no per-request task or copy, unlike Starlette's BaseHTTPMiddleware):
    refuses a body over ``max_bytes`` before the application reads it all."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0  # the server (h11/httptools) refuses a malformed length itself
                if declared > self.max_bytes:
                    # Answer at once: the body stays unread in the socket, and the server drops it.
                    await _send_error(send, self._too_large(), anthropic=scope["path"].startswith("/v1/messages"))
                    return
                break
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read, so the router's own error handler answers.
                    raise self._too_large()
            return message

        await self.app(scope, bounded, send)

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"request body is larger than this router's limit of {self.max_bytes} bytes (TANDEM_ROUTER_MAX_BODY_BYTES)"
        )


async def _send_error(send: Send, exc: PayloadTooLarge, *, anthropic: bool = False) -> None:
    """The 413 in the route's API shape (the Messages API's is Anthropic's)."""
    shape = {"type": "error", "error": {"type": "request_too_large", "message": exc.message}}
    body = json.dumps(shape if anthropic else error_from_exception(exc)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": exc.status_code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def parse_json(raw: bytes, max_depth: int) -> Any:
    """The body as JSON, refused (400) when invalid or nested deeper than ``max_depth``."""
    try:
        data = json.loads(raw)
    except RecursionError as exc:  # deeper than the C decoder's recursion limit: never a 500
        raise _too_deep(max_depth) from exc
    except ValueError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    check_depth(data, max_depth)
    return data


def check_depth(data: Any, max_depth: int) -> None:
    """Iterative (no recursion to exhaust) walk over containers only: strings and numbers are leaves,
    so a chat request costs a few microseconds per message."""
    stack: list[tuple[Iterable[Any], int]] = []
    if isinstance(data, dict):
        stack.append((data.values(), 1))
    elif isinstance(data, list):
        stack.append((data, 1))
    while stack:
        children, depth = stack.pop()
        if depth > max_depth:
            raise _too_deep(max_depth)
        for child in children:
            if isinstance(child, dict):
                stack.append((child.values(), depth + 1))
            elif isinstance(child, list):
                stack.append((child, depth + 1))


def _too_deep(max_depth: int) -> InvalidRequest:
    return InvalidRequest(
        f"request body is nested deeper than {max_depth} levels (TANDEM_ROUTER_MAX_JSON_DEPTH)", code="json_too_deep"
    )


def message_chars(message: dict[str, Any]) -> int:
    """Characters of a message's content: a string, or the text of each part of a list of parts."""
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, dict):
                total += sum(len(v) for v in part.values() if isinstance(v, str))
                for v in part.values():  # {"type": "image_url", "image_url": {"url": "data:..."}}
                    if isinstance(v, dict):
                        total += sum(len(x) for x in v.values() if isinstance(x, str))
            elif isinstance(part, str):
                total += len(part)
        return total
    return 0


def check_chat(
    messages: list[dict[str, Any]],
    extra: dict[str, Any],
    *,
    max_messages: int,
    max_message_chars: int,
    trust_request_chat_template: bool,
    allowed_template_kwargs: frozenset[str],
) -> None:
    """Limits on a chat request's messages and on what it may ask of the chat template."""
    if len(messages) > max_messages:
        raise InvalidRequest(
            f"{len(messages)} messages is more than this router's limit of {max_messages} (TANDEM_ROUTER_MAX_MESSAGES)",
            param="messages",
            code="too_many_messages",
        )
    for i, m in enumerate(messages):
        n = message_chars(m)
        if n > max_message_chars:
            raise InvalidRequest(
                f"messages[{i}] has {n} characters, more than this router's limit of "
                f"{max_message_chars} (TANDEM_ROUTER_MAX_MESSAGE_CHARS)",
                param=f"messages.{i}.content",
                code="message_too_large",
            )
    if extra.get("chat_template") is not None and not trust_request_chat_template:
        # The router renders the template itself (to count and route by tokens): an untrusted template
        # is code the router would run, with no time limit a thread can enforce.
        raise InvalidRequest(
            "chat_template is not allowed: this cluster does not trust request chat templates "
            "(TANDEM_ROUTER_TRUST_REQUEST_CHAT_TEMPLATE)",
            param="chat_template",
            code="chat_template_not_allowed",
        )
    kwargs = extra.get("chat_template_kwargs")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise InvalidRequest(
            "chat_template_kwargs must be an object",
            param="chat_template_kwargs",
            code="chat_template_kwargs_not_allowed",
        )
    for name, value in kwargs.items():
        if name not in allowed_template_kwargs:
            raise InvalidRequest(
                f"chat_template_kwargs.{name} is not allowed; allowed: "
                f"{', '.join(sorted(allowed_template_kwargs))} "
                "(TANDEM_ROUTER_CHAT_TEMPLATE_KWARGS)",
                param=f"chat_template_kwargs.{name}",
                code="chat_template_kwargs_not_allowed",
            )
        if value is not None and not isinstance(value, bool | int | float | str):
            raise InvalidRequest(
                f"chat_template_kwargs.{name} must be a boolean, number or string",
                param=f"chat_template_kwargs.{name}",
                code="chat_template_kwargs_not_allowed",
            )
