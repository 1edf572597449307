"""One generation request's life, from its arrival to its record: one object owns all of it.

``POST /v1/chat/completions`` and ``/v1/completions`` are served by an ``Exchange`` each, as a plain
ASGI app, so the response is sent inside the exchange's own ``try``/``finally`` (a FastAPI endpoint
returns its response and loses hold of it before the response is sent)::

    admit      key, requests/min, a tenant stream slot     401, 429 (before anything else is judged)
    read       body, edge rules, session and history       400, 413, 422
    plan       route, token charge, node slots, prefill    400, 429, 503, 502
    open       the decode leg, up to its first events      502 (retried once on another node first)
    respond    SSE relay (router.edge.sse) or one JSON answer
    exit       exactly once, whatever happened: close the upstream call (which aborts the engine's
               request), release the node slots, the tenant's stream slot and the policy's count, free
               a prefill lease no decode leg took, then one record (metrics, lake, response index,
               session turn, token settle)

A client that disconnects is noticed by one watcher for the request's whole life
(``router.edge.disconnect.DisconnectWatch``, armed once the body is read): it cancels the exchange's task
wherever it waits (planning, opening, relaying), and the exchange tells that cancellation from a
server shutdown. Either way the exit above runs, once: no slot, lease or engine request outlives the
client.
"""

from __future__ import annotations

import asyncio
import re
import time
from contextlib import AsyncExitStack
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from contracts.errors import InvalidRequest, ModelNotFound, PermissionDenied, TandemError, ValidationFailed
from router.admission.context import AdmissionContext
from router.admission.deadline import DEADLINE_HEADER, request_deadline
from router.admission.keys import Tenant
from router.admission.ratelimit import Admission
from router.edge.codecs.intake import Intake, decode, error_response
from router.edge.codecs.internal import Api, Completion
from router.edge.codecs.openapi import document_agent_routes
from router.edge.codecs.relay import CodecRelay, build_answer, completion_from_chat, output_messages, stream_encoder
from router.edge.codecs.socket_turn import SocketTurn
from router.edge.codecs.store import ResponseStore, StoredResponse
from router.edge.disconnect import DisconnectWatch
from router.edge.limits import check_chat, parse_json
from router.edge.openai_errors import document_error_schema, error_responses, response_for
from router.edge.schemas import ChatCompletionRequest, CompletionRequest, Message
from router.edge.sse import RelayResponse
from router.planning.cache_salt import CacheSalts, take_client_salt
from router.planning.orchestrator import Kind, Leg, Orchestrator, RequestTrace, new_request_id
from router.record.accounting import Accounting
from router.sessions.http import HISTORY_HEADER, HistoryMode, prepend_history, session_params
from router.sessions.models import _ID, SESSION_HEADER
from router.settings import RouterSettings

UNKNOWN_MODEL = "(unknown)"
"""The metrics label of every request naming a model no node serves (nor the model table,
``router.model_table``): client strings never become label values (each would be a new time series,
kept forever). The lake's ``requested_model`` keeps what the client sent."""


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()  # bounded by BodyLimit: never more than max_body_bytes
    settings = request.app.state.settings
    data = parse_json(raw, settings.max_json_depth, settings.max_json_containers)
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise ValidationFailed(f"{loc or 'body'}: {first.get('msg')}", param=loc or None, code="invalid_value") from exc


def route_preference(request: Request, tenant: Tenant, settings: RouterSettings) -> str | None:
    prefer = request.headers.get("x-tandem-route")
    if prefer is None:
        return None
    if prefer not in ("colocated", "disaggregated"):
        raise InvalidRequest("x-tandem-route must be `colocated` or `disaggregated`", param="x-tandem-route")
    allowed = settings.route_header == "always" or (settings.route_header == "auto" and tenant.may_administer)
    if not allowed:
        # Forcing the path overrides the policy's placement (and P/D load balance): operators only.
        raise PermissionDenied(
            "x-tandem-route needs an admin key (or TANDEM_ROUTER_ROUTE_HEADER=always)", param="x-tandem-route"
        )
    return prefer


NODE_HEADER = "x-tandem-node"
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,254}")
"""A node id as node agents make them (host name, a dash, a hex suffix; ``tandem up``'s role-port)."""


def node_pin(request: Request, tenant: Tenant, settings: RouterSettings, prefer: str | None) -> str | None:
    """The node an operator pins the request to (``x-tandem-node``), gated as ``x-tandem-route`` is:
    pinning overrides the policy's placement and load balance (benchmarks' probes, debugging one node)."""
    node = request.headers.get(NODE_HEADER)
    if node is None:
        return None
    if not _NODE_ID.fullmatch(node):
        raise InvalidRequest(f"{NODE_HEADER} must be a node id (as /cluster lists them)", param=NODE_HEADER)
    allowed = settings.route_header == "always" or (settings.route_header == "auto" and tenant.may_administer)
    if not allowed:
        raise PermissionDenied(
            f"{NODE_HEADER} needs an admin key (or TANDEM_ROUTER_ROUTE_HEADER=always)", param=NODE_HEADER
        )
    if prefer == "disaggregated":
        # A pinned node serves the request alone: a P/D pair would put half of it elsewhere.
        raise InvalidRequest(f"{NODE_HEADER} cannot be combined with x-tandem-route: disaggregated", param=NODE_HEADER)
    return node


class GenerationRoute:
    """The ASGI app of one generation endpoint: an ``Exchange`` per request."""

    def __init__(self, kind: Kind, endpoint: str, api: Api | None = None) -> None:
        self.kind = kind
        self.endpoint = endpoint
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = Exchange(Request(scope, receive, send), self.kind, self.endpoint, self.api)
        await exchange.run(scope, receive, send)


class Exchange:
    """One request's life (see the module docstring). ``run`` is the list of steps; ``_exit`` is the
    one place that lets go of what the request holds."""

    def __init__(
        self, request: Request, kind: Kind, endpoint: str, api: Api | None = None, socket: SocketTurn | None = None
    ) -> None:
        state = request.app.state
        self.api = api
        self.socket = socket
        """The WebSocket this request is one message of (``router.edge.codecs.websocket``); None: plain HTTP."""
        self.store: ResponseStore = socket.responses if socket is not None else state.response_store
        """The edge API when not chat/completions (``router.edge.codecs``): decoded at the edge, encoded back."""
        self.intake: Intake | None = None
        self.request = request
        self.kind = kind
        self.endpoint = endpoint
        self.settings: RouterSettings = state.settings
        self.orch: Orchestrator = state.orchestrator
        self.accounting: Accounting = state.accounting
        self.ctx: AdmissionContext = state.admission
        self.salts: CacheSalts = state.cache_salts
        self.spawn = state.kv_tasks.spawn
        self.holds = AsyncExitStack()
        """Everything the request holds that must be let go (upstream call, slots, policy count)."""
        self.admission: Admission | None = None
        self.trace: RequestTrace | None = None
        self.messages: list[dict[str, Any]] | None = None
        self.leg: Leg | None = None
        self.watch: DisconnectWatch | None = None
        """Armed from the moment the body is read (``_answer``) until the answer's end is sent."""
        self.codec: CodecRelay | None = None
        self.outcome: tuple[str, int, TandemError | None] = ("cancelled", 499, None)
        """(status, HTTP status, error) for the record; until the answer is complete, a request that
        ends is one the client (or the server's shutdown) abandoned."""

    async def run(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            try:
                response = await self._answer(receive)
            except asyncio.CancelledError:
                if not self._client_left():
                    raise  # the server is shutting down: not ours to swallow
                self._abandon("client disconnected")
                response = Response(status_code=499)
            except TandemError as exc:
                if isinstance(exc, ModelNotFound) and self.trace is not None:
                    self.trace.model = UNKNOWN_MODEL
                self._abandon(f"request failed: {exc.message}")
                rejected = exc.status_code < 500 or exc.status_code == 503
                self.outcome = ("rejected" if rejected else "error", exc.status_code, exc)
                response = error_response(self.api, exc) if self.api else response_for(exc)
            if self.watch is not None and not isinstance(response, RelayResponse):
                self.watch.disarm()  # one write; the relay disarms before its own last one
            try:
                await response(scope, receive, send)
            except asyncio.CancelledError:
                if not self._client_left():
                    raise  # the relay recorded the stream as cancelled either way
        finally:
            if self.watch is not None:
                self.watch.close()
            await self._exit()

    def _client_left(self) -> bool:
        """Whether the cancellation being handled is the disconnect watch's (then undone)."""
        return self.watch is not None and self.watch.absorb()

    async def _answer(self, receive: Receive) -> Response:
        """admit, read, plan, open: everything before the first byte of the answer."""
        request, ctx = self.request, self.ctx
        arrival = time.monotonic()
        # Authentication and the request-rate limit come first: an unauthenticated client learns
        # nothing else about the request (401/429 before any 400).
        authorization = request.headers.get("authorization")
        if authorization is None and self.api == "messages" and request.headers.get("x-api-key"):
            authorization = f"Bearer {request.headers['x-api-key']}"  # Anthropic's own key header
        admission = self.admission = await ctx.gate.admit(
            authorization, priority_header=request.headers.get("x-tandem-priority")
        )
        # One of the tenant's stream slots, held until ``_exit`` (every way a request ends goes through it).
        self.holds.callback(ctx.streams.acquire(admission.tenant.tenant_id))
        if self.api is not None:
            raw = parse_json(await request.body(), self.settings.max_json_depth, self.settings.max_json_containers)
            self.intake = await decode(self.api, raw, dict(request.headers), self.store, admission.tenant.tenant_id)
            req = self.intake.chat
        else:
            req = await parse_body(request, ChatCompletionRequest if self.kind == "chat" else CompletionRequest)
        # From here until the answer's end, a client that leaves cancels this task (router.edge.disconnect).
        self.watch = DisconnectWatch(receive)
        tenant = admission.tenant
        cache_salt = self.salts.salt(
            tenant.tenant_id, authenticated=tenant.key_id is not None, client_salt=take_client_salt(req.model_extra)
        )
        prefer = route_preference(request, admission.tenant, self.settings)
        pin = node_pin(request, admission.tenant, self.settings, prefer)
        deadline = request_deadline(
            request.headers.get(DEADLINE_HEADER), ctx.settings.request_deadline_s, arrival=arrival
        )
        session_header = self.intake.session_id if self.intake is not None else request.headers.get(SESSION_HEADER)
        socket_session = self.socket.session_id if self.socket is not None else None
        session = await session_params(session_header or socket_session, request.headers.get(HISTORY_HEADER))
        # A request that names no session is sessionless, as with OpenAI or vLLM: storing a session and
        # a turn for each such request cost a Redis read and four writes plus a database row every time,
        # for ids that no client ever sent back. In server-history mode the router keeps the history,
        # so there a session is created and its id returned.
        session_id = session.session_id if not session.created or session.mode is HistoryMode.SERVER else None
        trace = RequestTrace(
            request_id=new_request_id(self.kind),
            kind=self.kind,
            model=req.model,
            stream=req.stream,
            transport="http" if self.socket is None else "websocket",
            session_id=session_id,
            tenant_id=admission.tenant.tenant_id,
            priority=admission.priority,
            deadline=deadline,
        )
        messages = [m.model_dump(exclude_none=True) for m in req.messages] if self.kind == "chat" else None
        if messages is not None:
            s = self.settings
            check_chat(
                messages,
                req.model_extra or {},
                max_messages=s.max_messages,
                max_message_chars=s.max_message_chars,
                trust_request_chat_template=s.trust_request_chat_template,
                allowed_template_kwargs=s.chat_template_kwargs,
            )
        if session.mode is HistoryMode.SERVER:
            if messages is None or session_id is None:
                raise InvalidRequest(f"{HISTORY_HEADER}: server applies to chat completions only", param=HISTORY_HEADER)
            messages = await prepend_history(ctx.sessions, admission.tenant.tenant_id, session_id, messages)
            req.messages = [Message.model_validate(m) for m in messages]
        # From here on the request has a record: whatever way it ends, ``_exit`` writes it.
        self.trace, self.messages = trace, messages
        headers = {"x-session-id": session_id} if session_id else {}

        async def charge(prompt_tokens: int, max_tokens: int | None) -> None:
            await ctx.gate.charge_tokens(admission, prompt_tokens, max_tokens)

        # No token bucket, no charge: the prompt is then tokenized only if routing needs it.
        charges = charge if ctx.gate.charges_tokens(admission) else None
        plan = self.orch.plan(self.kind, req, trace, prefer, charges, cache_salt, self.spawn, pin)  # type: ignore[arg-type]
        leg = self.leg = await plan
        self.holds.push_async_callback(leg.release)
        if not req.stream:
            answer = await self.orch.complete(leg, trace, self.spawn)
            self.outcome = ("ok", 200, None)
            if self.intake is not None:
                done = completion_from_chat(answer)
                answer = build_answer(self.intake.internal, done, self.intake.response_id)
                self._store(done, answer)
            return JSONResponse(answer, headers=headers)
        stream = await self.orch.open_stream(leg, trace, self.holds, self.spawn)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.codec = stream_encoder(self.intake.internal, trace, self.intake.response_id) if self.intake else None
        return RelayResponse(
            stream,
            trace,
            include_usage,
            self._relayed,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
            send_timeout_s=self.settings.client_send_timeout_s,
            watch=self.watch,
            encoder=self.codec,
        )

    def _relayed(self, status: str, error: TandemError | None) -> None:
        """The relay's verdict: a stream that started is a 200 whatever happened after."""
        self.outcome = (status, 200, error)
        if self.codec is not None and status == "ok":
            final = self.codec.final()
            if final is not None:
                self._store(self.codec.done(), final)

    def _store(self, done: Completion, answer: dict[str, Any]) -> None:
        """A Responses answer the client may chain on (``previous_response_id``)."""
        intake = self.intake
        if intake is None or intake.internal.api != "responses":
            return
        trace = self.trace
        record = StoredResponse(
            messages=[*intake.internal.messages, *output_messages(done)],
            input_count=len(intake.internal.messages),
            response=answer,
            session_id=(trace.session_id if trace is not None else None) or intake.response_id,
        )
        tenant = trace.tenant_id if trace is not None else None
        # ``store: false`` keeps nothing, but a socket's own last response (OpenAI's WebSocket mode).
        self.spawn(self.store.save(tenant, intake.response_id, record, durable=intake.internal.store is not False))

    def _abandon(self, reason: str) -> None:
        """The answer will not come from the planned legs: free the prefill node's lease now."""
        if self.leg is not None:
            self.orch.abandon(self.leg, reason, self.spawn)

    async def _exit(self) -> None:
        # Shielded: under cancellation (server shutdown) every await would raise again, and the upstream
        # call must be closed for the engine to abort the request and free its blocks.
        with anyio.CancelScope(shield=True):
            await self.holds.aclose()
        trace = self.trace
        if trace is None:
            return  # refused before it was read: nothing held, nothing to record
        trace.finish = trace.finish or time.time()
        if trace.model_resolution is None and not self.orch.bounded(trace.model):
            trace.model = UNKNOWN_MODEL  # refused before routing: the client's name is no label
        status, http_status, error = self.outcome
        self.accounting.finish(
            trace,
            self.endpoint,
            status,
            http_status=http_status,
            exc=error,
            admission=self.admission,
            messages=self.messages,
        )


def document_generation_routes(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the generation routes, which are plain ASGI apps FastAPI cannot see, to an OpenAPI
    document: their request models (``router.edge.schemas``) and the OpenAI-shaped error answers."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    document_error_schema(schema)
    session = {
        "name": SESSION_HEADER,
        "in": "header",
        "required": False,
        "description": "The session this request belongs to (answered in the same header); empty: none",
        # An empty value is taken as no header at all (``session_params``).
        "schema": {"type": "string", "pattern": f"^({_ID.pattern.removeprefix('^').removesuffix('$')})?$"},
    }
    # Server-history mode is for chat only (a completion naming it is a 400).
    history = {
        "name": HISTORY_HEADER,
        "in": "header",
        "required": False,
        "description": "client (default): the client sends the whole history; server: the router prepends it",
        "schema": {"type": "string", "enum": [m.value for m in HistoryMode]},
    }
    for path, model, summary, parameters in (
        (
            "/v1/chat/completions",
            ChatCompletionRequest,
            "Create a chat completion (SSE when stream is true)",
            [session, history],
        ),
        ("/v1/completions", CompletionRequest, "Create a completion (SSE when stream is true)", [session]),
    ):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema.setdefault("paths", {})[path] = {
            "post": {
                "summary": summary,
                "operationId": model.__name__.replace("Request", "").lower(),
                "parameters": parameters,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
                },
                "responses": {
                    "200": {
                        "description": "The answer: JSON, or an SSE stream of chunks ending with [DONE]",
                        "headers": {
                            SESSION_HEADER: {
                                "description": "The request's session (named, or made in server-history mode)",
                                "schema": {"type": "string"},
                            }
                        },
                        "content": {
                            "application/json": {"schema": {"type": "object"}},
                            # OpenAPI 3.1: the schema of each event (``data: <chunk JSON>``, ``data: [DONE]`` last)
                            "text/event-stream": {
                                "schema": {
                                    "type": "object",
                                    "required": ["data"],
                                    "properties": {
                                        "data": {"type": "string", "description": "A chunk as JSON, or [DONE]"},
                                        "event": {"type": "string"},
                                        "id": {"type": "string"},
                                    },
                                }
                            },
                        },
                    },
                    **{
                        str(code): doc
                        for code, doc in error_responses(400, 401, 403, 404, 413, 422, 429, 502, 503).items()
                    },
                },
            }
        }
    document_agent_routes(
        schema,
        {str(code): doc for code, doc in error_responses(400, 401, 403, 404, 413, 422, 429, 502, 503).items()},
    )
    return schema
