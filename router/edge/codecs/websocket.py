"""One connection for a whole agent session: ``GET /v1/responses`` and ``GET /v1/chat/completions``
upgraded to a WebSocket.

OpenAI's WebSocket mode for Responses (Codex CLI uses it when its provider says ``supports_websockets``):
the client authenticates once, at the upgrade, then sends ``response.create`` messages (the body of a
``POST /v1/responses``, streamed implicitly) and gets back, per message, the same typed events the SSE
stream carries, one JSON object per text message. Chat Completions get the same idea: one chat request
body per message, the SSE ``data:`` payloads back one per message, ``[DONE]`` last::

    upgrade      the key (Authorization, x-api-key, or the ``openai-insecure-api-key.<key>`` subprotocol)
                 checked once: a refusal is the HTTP answer to the upgrade (401, or 429 past the
                 tenant's ``ws_max_per_tenant`` open sockets), in the API's error shape
    message      one response at a time: it runs through the cluster's one generation path
                 (``router.edge.exchange.Exchange``, admitted and rate-limited per response, planned,
                 relayed, recorded), its events written to the socket as they come; a second
                 ``response.create`` meanwhile gets an ``error`` event and the socket stays open
    prewarm      a ``response.create`` with ``"generate": false`` (Codex's first message on a socket): answered
                 at once, ``response.created`` then ``response.completed`` with no output, no engine
                 work and no record (it served nothing); one in flight makes it a busy error as above
    cancel       ``response.cancel`` (or the socket closing) cancels the response in flight
                 everywhere, as a client leaving an SSE stream does, then an ``error`` event
                 ``response_cancelled`` ends it on a socket still open
    idle         no response and no message for ``ws_idle_timeout_s``: closed with 1000
    age          past ``ws_max_age_s``, between responses: ``websocket_connection_limit_reached``,
                 closed with 1000 (clients reconnect)
    stalled      a client that reads nothing for ``client_send_timeout_s``: its response is cut and
                 its engine work freed (the relay's own rule), the connection dropped with what it did
                 not read (a close frame would wait behind it): the client sees 1006 and may reconnect
    restart      a router replica that stops closes its sockets with 1012 (uvicorn's shutdown), a code
                 the OpenAI SDKs reconnect on

The socket is the session: a response naming no session belongs to the socket's (the upgrade's
``x-session-id``, else one made for the socket), so its turns share affinity, retention and the lake's
session; its retention lasts at least the idle timeout (``router.planning.retention.retention_default``);
its last response stays in memory, so the next ``previous_response_id`` needs no store read, even
with ``store: false`` (``router.edge.codecs.store.SocketResponses``); and its last prompt stays encoded, so
the next one, which repeats it, is encoded from its end only (``router.tokenizer.PrefixTokens``: the
largest part of the router's work per turn on a long conversation).

Each response is an ``Exchange`` over an in-process ASGI pair (``_Bridge``): ``receive`` hands it the
message as the request body and then reports a disconnect when the response is cancelled; ``send``
splits the SSE bytes it writes into frames and forwards each ``data:`` payload as one text message.
So the exchange's whole contract (slots, leases, engine aborts, one record) holds unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import socket
import struct
import time
import uuid
from collections import Counter
from collections.abc import MutableMapping
from typing import Any, Literal

import msgspec
from fastapi import APIRouter
from starlette.requests import Request
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from contracts.errors import RateLimited, TandemError
from router.edge.codecs import internal as ir
from router.edge.codecs.intake import decode
from router.edge.codecs.internal import Api
from router.edge.codecs.responses import ResponsesStreamEncoder
from router.edge.codecs.socket_turn import SocketTurn
from router.edge.codecs.store import ResponseStore, SocketResponses, StoredResponse
from router.edge.codecs.websocket_frames import (
    Bad,
    Cancel,
    Create,
    Prewarm,
    busy_event,
    error_event,
    parse_client_message,
)
from router.edge.direct_write import RAW_SEND
from router.edge.openai_errors import error_from_exception, response_for
from router.edge.services import services_of
from router.sessions.models import SESSION_HEADER, validate_id
from router.tokenizer import SESSION_TOKENS

log = logging.getLogger(__name__)

SocketApi = Literal["responses", "chat"]
KEY_SUBPROTOCOL = "openai-insecure-api-key."
"""Browsers cannot set headers on a WebSocket: OpenAI's clients pass the key as this subprotocol."""
_HOP = frozenset(
    {b"connection", b"upgrade", b"content-length", b"transfer-encoding", b"host", b"authorization", b"x-api-key"}
)
_encode = msgspec.json.encode
CLOSE_NORMAL, CLOSE_POLICY = 1000, 1008


class SocketTable:
    """Open sockets per tenant on this replica (the ``ws_max_per_tenant`` cap)."""

    def __init__(self) -> None:
        self.open: Counter[str] = Counter()

    def take(self, tenant: str, cap: int) -> bool:
        if self.open[tenant] >= cap:
            return False
        self.open[tenant] += 1
        return True

    def give(self, tenant: str) -> None:
        self.open[tenant] -= 1
        if self.open[tenant] <= 0:
            del self.open[tenant]


def _key_from(ws: WebSocket) -> tuple[str | None, str | None]:
    """(Authorization value, the subprotocol to answer with) from the upgrade request."""
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    key = next((p.removeprefix(KEY_SUBPROTOCOL) for p in offered if p.startswith(KEY_SUBPROTOCOL)), None)
    others = [p for p in offered if not p.startswith(KEY_SUBPROTOCOL)]
    subprotocol = others[0] if others else None
    authorization = ws.headers.get("authorization")
    if authorization is None and ws.headers.get("x-api-key"):
        authorization = f"Bearer {ws.headers['x-api-key']}"
    if authorization is None and key:
        authorization = f"Bearer {key}"
    return authorization, subprotocol


class _Bridge:
    """The ASGI ``receive``/``send`` of one response's exchange (see the module docstring)."""

    def __init__(self, ws: WebSocket, body: bytes, api: SocketApi) -> None:
        self.ws, self.body, self.api = ws, body, api
        self.left = asyncio.Event()
        """Set by ``response.cancel`` or the socket closing: the exchange's receive reports a disconnect."""
        self.cancelled = False
        self.status: int | None = None
        self.ended = False
        """The exchange wrote the end of its answer (a stream cut by a stalled client never does)."""
        self._buf = b""
        self._error = b""
        self._body_sent = False

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            return
        if message["type"] != "http.response.body":
            return
        data: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if self.status == 200:
            self._buf += data
            *frames, self._buf = self._buf.split(b"\n\n")
            for frame in frames:
                await self._forward(frame)
        else:
            self._error += data
        if not more:
            self.ended = True
            if self.status != 200:
                await self._refused()

    async def _forward(self, frame: bytes) -> None:
        for line in frame.split(b"\n"):
            if line.startswith(b"data: "):
                payload = line[6:]
                if payload == b"[DONE]" and self.api == "responses":
                    return
                await self.text(payload.decode())

    async def _refused(self) -> None:
        """A request refused before its stream began: the API's error body, as an event on the socket."""
        try:
            body = msgspec.json.decode(self._error) if self._error else {}
        except msgspec.DecodeError:
            body = {}
        error = body.get("error") if isinstance(body, dict) else None
        if self.api == "responses":
            await self.text(_encode(_refusal(self.status, error or {})).decode())
        else:
            await self.text(_encode({"error": error or {}}).decode())

    async def text(self, payload: str) -> None:
        if self.left.is_set() and not self.cancelled:
            return  # the socket is gone: the exchange is being cancelled, nothing to write to
        try:
            await self.ws.send_text(payload)
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.left.set()  # the next receive() tells the exchange its client left


class SocketSession:
    """One accepted socket: its loop of messages, at most one response in flight."""

    def __init__(
        self, ws: WebSocket, api: SocketApi, session_id: str, authorization: str | None, tenant_id: str | None = None
    ) -> None:
        self.ws, self.api = ws, api
        self.tenant_id = tenant_id
        """The tenant the upgrade authenticated (a prewarm's answer is kept under it)."""
        path = "/v1/responses" if api == "responses" else "/v1/chat/completions"
        self.scope = _http_scope(ws, path, authorization)
        """Every message's request scope: the upgrade's, as a POST to the HTTP route (a copy per message)."""
        state = services_of(ws)
        self.settings = state.settings
        store: ResponseStore = state.response_store
        self.turn = SocketTurn(SocketResponses(store), session_id)
        self.opened = time.monotonic()
        self.bridge: _Bridge | None = None
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        receiving: asyncio.Task[MutableMapping[str, Any]] = asyncio.ensure_future(self.ws.receive())
        try:
            while True:
                waits: set[asyncio.Future[Any]] = {receiving}
                if self.task is not None:
                    waits.add(self.task)
                idle = None if self.task is not None else self.settings.ws_idle_timeout_s
                done, _ = await asyncio.wait(waits, timeout=idle, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    await self._close(CLOSE_NORMAL, "idle timeout")
                    return
                if self.task is not None and self.task in done:
                    if not await self._response_ended():
                        return
                if receiving in done:
                    message = receiving.result()
                    if message["type"] == "websocket.disconnect":
                        return
                    receiving = asyncio.ensure_future(self.ws.receive())
                    await self._on_message(message.get("text") or message.get("bytes") or b"")
        finally:
            receiving.cancel()
            await self._drop()

    async def _on_message(self, text: str | bytes) -> None:
        s = self.settings
        parsed = parse_client_message(text, self.api, s.max_body_bytes, s.max_json_depth, s.max_json_containers)
        if isinstance(parsed, Bad):
            await self._event(parsed.event)
        elif isinstance(parsed, Cancel):
            if self.bridge is not None and self.task is not None:
                self.bridge.cancelled = True
                self.bridge.left.set()
        elif self.task is not None:
            await self._event(busy_event() if self.api == "responses" else _chat_busy())
        elif isinstance(parsed, Prewarm):
            await self._prewarm(parsed)
        else:
            self._start(parsed)

    async def _prewarm(self, prewarm: Prewarm) -> None:
        """A prewarm's answer: a completed response with no output (OpenAI's WebSocket mode), kept as the
        socket's last response, so that a turn chained on it (``previous_response_id``, as Codex sends its
        first turn) has the prewarm's input as history. Run as a generation it would hold the socket for
        a whole prefill and more, and Codex drops a socket whose prewarm has not completed by the time
        its first turn is ready (then sends the turn on a new one)."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in self.scope["headers"]}
        try:
            intake = await decode("responses", prewarm.body, headers, self.turn.responses, self.tenant_id)
        except TandemError as exc:
            await self._event(_refusal(exc.status_code, error_from_exception(exc)["error"]))
            return
        # The Response object as a generated answer has it (the encoder's), with no output and no tokens.
        enc = ResponsesStreamEncoder(intake.internal, intake.response_id)
        await self._event({"type": "response.created", "sequence_number": 0, "response": enc.response("in_progress")})
        enc.feed(ir.Usage(prompt_tokens=0, cached_tokens=0, completion_tokens=0))
        done = enc.response("completed")
        messages = list(intake.internal.messages)
        record = StoredResponse(messages, len(messages), done, intake.session_id or self.turn.session_id)
        await self.turn.responses.save(self.tenant_id, intake.response_id, record, durable=False)
        await self._event({"type": "response.completed", "sequence_number": 1, "response": done})

    def _start(self, create: Create) -> None:
        from router.edge.exchange import Exchange  # the exchange imports the codecs: import it when used

        bridge = self.bridge = _Bridge(self.ws, _encode(create.body), self.api)
        scope = dict(self.scope)
        request = Request(scope, bridge.receive, bridge.send)
        api: Api | None = "responses" if self.api == "responses" else None
        exchange = Exchange(request, "chat", self.api, api, socket=self.turn)
        context = contextvars.copy_context()
        context.run(SESSION_TOKENS.set, self.turn.tokens)  # the response's tokenizing resumes the socket's
        self.task = asyncio.create_task(exchange.run(scope, bridge.receive, bridge.send), context=context)

    async def _response_ended(self) -> bool:
        """The response in flight ended; False when the socket must close."""
        task, bridge = self.task, self.bridge
        self.task = self.bridge = None
        assert task is not None and bridge is not None
        if task.cancelled() or task.exception() is not None:
            log.error("a response on a socket failed: %r", None if task.cancelled() else task.exception())
            await self._close(1011, "internal error")
            return False
        if bridge.cancelled:
            await self._event(error_event("response_cancelled", "the response was cancelled", None))
        elif not bridge.ended:
            # The relay cut a client that read nothing for client_send_timeout_s: a close frame would
            # queue behind what it does not read, so the connection is dropped with its buffer.
            self._abort()
            return False
        if time.monotonic() - self.opened > self.settings.ws_max_age_s:
            await self._event(
                error_event(
                    "websocket_connection_limit_reached",
                    f"a socket lives at most {self.settings.ws_max_age_s:g} s; open a new one",
                )
            )
            await self._close(CLOSE_NORMAL, "connection age limit")
            return False
        return True

    async def _event(self, event: dict[str, Any]) -> None:
        try:
            await self.ws.send_text(_encode(event).decode())
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass

    async def _close(self, code: int, reason: str) -> None:
        if self.ws.client_state is WebSocketState.CONNECTED:
            try:
                await asyncio.wait_for(self.ws.close(code, reason), 5.0)
            except (TimeoutError, RuntimeError, OSError):
                pass

    def _abort(self) -> None:
        """Drop the connection now, unsent bytes and all (uvicorn's transport, found as the relay finds
        it: ``router.edge.direct_write``). Under another server the handler just returns and the server
        closes the connection its own way."""
        protocol = getattr(self.ws.scope.get(RAW_SEND), "__self__", None)
        transport = getattr(protocol, "transport", None)
        if transport is not None and hasattr(transport, "abort"):
            sock = transport.get_extra_info("socket")
            if sock is not None:
                # Linger 0: the kernel resets the connection and frees its send buffer (megabytes the
                # client would otherwise still trickle in) instead of sending it before the close.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()

    async def _drop(self) -> None:
        """The socket is done: a response still in flight is cancelled, as an SSE client leaving cancels."""
        task, bridge = self.task, self.bridge
        if task is None or bridge is None:
            return
        bridge.left.set()
        try:
            await asyncio.shield(task)
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 — its exit has run; nothing to tell a client
            pass


def _refusal(status: int | None, error: dict[str, Any]) -> dict[str, Any]:
    """A Responses request refused before any output, as an ``error`` event with the HTTP status it
    would have had."""
    return {"type": "error", "status": status, "error": error}


def _chat_busy() -> dict[str, Any]:
    return {"error": busy_event()["error"]}


def _http_scope(ws: WebSocket, path: str, authorization: str | None) -> dict[str, Any]:
    """The scope of a message's request: the upgrade's, as a POST of JSON to the HTTP route."""
    scope = {k: v for k, v in ws.scope.items() if k not in (RAW_SEND, "subprotocols", "extensions")}
    headers = [(k, v) for k, v in ws.scope["headers"] if k not in _HOP and not k.startswith(b"sec-websocket-")]
    headers.append((b"content-type", b"application/json"))
    if authorization:
        headers.append((b"authorization", authorization.encode("latin-1")))
    scope.update(
        type="http",
        method="POST",
        path=path,
        raw_path=path.encode(),
        query_string=b"",
        headers=headers,
        http_version="1.1",
        scheme="https" if ws.scope.get("scheme") == "wss" else "http",
    )
    return scope


async def serve(ws: WebSocket, api: SocketApi, table: SocketTable) -> None:
    """One upgrade: authenticate, take a slot of the tenant's, accept, run the socket's session."""
    state = services_of(ws)
    authorization, subprotocol = _key_from(ws)
    metrics = state.metrics
    try:
        tenant = await state.admission.gate.authenticate(authorization)
        session = ws.headers.get(SESSION_HEADER)
        session_id = validate_id(session, SESSION_HEADER) if session else f"ws-{uuid.uuid4().hex}"
        if not table.take(tenant.tenant_id, state.settings.ws_max_per_tenant):
            raise RateLimited(
                f"this tenant has {state.settings.ws_max_per_tenant} sockets open on this router "
                "(TANDEM_ROUTER_WS_MAX_PER_TENANT)",
                retry_after=state.settings.retry_after_s,
            )
    except TandemError as exc:
        metrics.ws_upgrades.labels(api, type(exc).__name__).inc()
        await _refuse(ws, api, exc)
        return
    metrics.ws_upgrades.labels(api, "accepted").inc()
    metrics.ws_open.labels(api).inc()
    try:
        await ws.accept(subprotocol=subprotocol)
        await SocketSession(ws, api, session_id, authorization, tenant.tenant_id).run()
    finally:
        metrics.ws_open.labels(api).dec()
        table.give(tenant.tenant_id)


async def _refuse(ws: WebSocket, api: SocketApi, exc: TandemError) -> None:
    """The upgrade's HTTP answer in the API's error shape; a server without the denial extension gets 1008."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(response_for(exc))
    else:
        await ws.close(CLOSE_POLICY, exc.message[:120])


def socket_router() -> APIRouter:
    """The two socket routes of one app, sharing its table of open sockets."""
    router = APIRouter()
    table = SocketTable()

    @router.websocket("/v1/responses")
    async def responses_socket(ws: WebSocket) -> None:
        await serve(ws, "responses", table)

    @router.websocket("/v1/chat/completions")
    async def chat_socket(ws: WebSocket) -> None:
        await serve(ws, "chat", table)

    return router
