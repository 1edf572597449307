"""What the router checks before it believes a client's request: size, shape, and fields it may not set.

Every check here is O(body size) at most and needs no Redis round trip, so it costs a normal request
microseconds (the router's CPU budget is a few milliseconds per request):

    bytes on the socket ──► BodyLimit (ASGI): headers over ``max_header_bytes`` in all → 431;
                            Content-Length over the limit → 413 before a byte is read;
                            a chunked body is counted as it arrives and refused (413) at the limit, so
                            the router never holds more than ``max_body_bytes`` of one request; a body
                            not complete within ``body_read_timeout_s`` of the request's start → 408
                            (a trickled upload would otherwise hold its stream slot for as long as
                            the client likes; the slot goes back with the error, as on every exit)
    body bytes ─────────► parse_json: invalid → 400 ``invalid_json``; nested deeper than the C decoder
                            can go (RecursionError) or than ``max_json_depth`` → 400 ``json_too_deep``;
                            an id-like field (``model``, ``user``, ...) over ``MAX_ID_CHARS`` → 400
                            ``string_too_long`` (a 10 MB model name was echoed in the 404 and stored
                            twice per request row in Redis)
    parsed request ─────► check_chat: message count and per-message size (400 ``too_many_messages``,
                            ``message_too_large``); a client ``chat_template`` unless the operator
                            trusts them (400 ``chat_template_not_allowed``, as vLLM's
                            ``--trust-request-chat-template``); ``chat_template_kwargs`` from an
                            allowlist, scalar values only (400 ``chat_template_kwargs_not_allowed``)

Fields the router itself sets for engines (``kv_transfer_params``, ...) are dropped from client input
by the request models (``router.edge.schemas.INTERNAL_FIELDS``), so no client can name a KV source or pin
blocks on a node. Why the limits are where they are: the router tokenizes the prompt itself (context
check, token limits, routing keys), at about 1 s of CPU per MB of text; an unbounded body was 110 s
and 3 GB of RSS for 100 MB.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts.errors import BodyReadTimeout, HeadersTooLarge, InvalidRequest, PayloadTooLarge, RequestError
from router.edge.openai_errors import error_from_exception

if TYPE_CHECKING:
    from router.settings import RouterSettings

MAX_ID_CHARS = 256
"""Longest ``model``, ``user`` or other id-like top-level string a body may carry (model ids on the
Hugging Face Hub are under 100 characters)."""
ID_FIELDS = ("model", "user", "previous_response_id", "prompt_cache_key", "safety_identifier", "service_tier")


class BodyLimit:
    """Pure ASGI middleware (no per-request task or copy, unlike Starlette's BaseHTTPMiddleware):
    refuses headers over ``max_header_bytes``, a body over ``max_bytes`` before the application reads it
    all, and a body still arriving ``read_timeout_s`` after the request began (0: no deadline)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, max_header_bytes: int = 64 * 1024, read_timeout_s: float = 0.0
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        anthropic = scope["path"].startswith("/v1/messages")
        header_bytes = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
        if header_bytes > self.max_header_bytes:
            await _send_error(send, self._headers_too_large(header_bytes), anthropic=anthropic)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0  # the server (h11/httptools) refuses a malformed length itself
                if declared > self.max_bytes:
                    # Answer at once: the body stays unread in the socket, and the server drops it.
                    await _send_error(send, self._too_large(), anthropic=anthropic)
                    return
                break
        received = 0
        deadline = time.monotonic() + self.read_timeout_s if self.read_timeout_s > 0 else None

        async def bounded() -> Message:
            nonlocal received, deadline
            if deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
                except TimeoutError:
                    raise self._read_timeout() from None
            if message["type"] == "http.request":
                if not message.get("more_body", False):
                    deadline = None  # the body is in: later reads wait for the client's disconnect
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read, so the router's own error handler answers.
                    raise self._too_large()
            return message

        await self.app(scope, bounded, send)

    @staticmethod
    def settings_of(settings: RouterSettings) -> dict[str, Any]:
        """This middleware's arguments from ``RouterSettings``."""
        return {
            "max_bytes": settings.max_body_bytes,
            "max_header_bytes": settings.max_header_bytes,
            "read_timeout_s": settings.body_read_timeout_s,
        }

    def _headers_too_large(self, size: int) -> HeadersTooLarge:
        return HeadersTooLarge(
            f"request headers are {size} bytes, more than this router's limit of {self.max_header_bytes} "
            "(TANDEM_ROUTER_MAX_HEADER_BYTES)"
        )

    def _read_timeout(self) -> BodyReadTimeout:
        return BodyReadTimeout(
            f"request body not received within {self.read_timeout_s:g} s (TANDEM_ROUTER_BODY_READ_TIMEOUT_S)"
        )

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"request body is larger than this router's limit of {self.max_bytes} bytes (TANDEM_ROUTER_MAX_BODY_BYTES)"
        )


async def _send_error(send: Send, exc: RequestError, *, anthropic: bool = False) -> None:
    """The 413 or 431 in the route's API shape (the Messages API's is Anthropic's)."""
    kind = "request_too_large" if exc.status_code == 413 else "invalid_request_error"
    shape = {"type": "error", "error": {"type": kind, "message": exc.message}}
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


def parse_json(raw: bytes, max_depth: int, max_containers: int = 200_000) -> Any:
    """The body as JSON, refused (400) when invalid, nested deeper than ``max_depth`` or holding more than
    ``max_containers`` arrays and objects (an upper bound counted before parsing: two C scans, about a
    millisecond a megabyte, where parsing 10 MiB of ``[],`` takes seconds of the event loop)."""
    if len(raw) > max_containers and raw.count(b"[") + raw.count(b"{") > max_containers:
        raise InvalidRequest(
            f"request body holds more than {max_containers} JSON arrays and objects "
            "(TANDEM_ROUTER_MAX_JSON_CONTAINERS)",
            code="too_many_containers",
        )
    try:
        data = json.loads(raw)
    except RecursionError as exc:  # deeper than the C decoder's recursion limit: never a 500
        raise _too_deep(max_depth) from exc
    except ValueError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    check_depth(data, max_depth)
    if isinstance(data, dict):
        check_ids(data)
    return data


def check_ids(data: dict[str, Any]) -> None:
    """Bound the id-like strings a client names things with (they are echoed, logged and stored)."""
    for name in ID_FIELDS:
        value = data.get(name)
        if isinstance(value, str) and len(value) > MAX_ID_CHARS:
            raise InvalidRequest(
                f"{name} has {len(value)} characters, more than this router's limit of {MAX_ID_CHARS}",
                param=name,
                code="string_too_long",
            )


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
