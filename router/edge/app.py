"""The router's HTTP edge: OpenAI-compatible API over FastAPI, SSE streaming, errors in OpenAI's shape.

    POST /v1/chat/completions   POST /v1/completions   (stream and non-stream)
    POST /v1/responses          POST /v1/messages      (the same path, decoded and encoded by router.edge.codecs)
    GET|DELETE /v1/responses/{id}   POST /v1/responses/{id}/cancel   GET /v1/responses/{id}/input_items
    POST /v1/messages/count_tokens
    GET  /v1/models             GET  /health           GET  /metrics          GET /cluster
    POST /v1/feedback

Once auth is on (a key exists, or ``TANDEM_AUTH=required``), every route but ``/health`` needs a key
(``/openapi.json``, ``/docs`` and ``/redoc`` included, and the document then says so; while auth is off
it says the key is optional, which is what the server does);
``/metrics`` and ``/cluster`` (node URLs, load) need an admin key (403 otherwise); feedback is accepted
only from the tenant that owns the response (another's → 404, as if it did not exist). Bodies are
bounded before they are read (``router.edge.limits``: 413, then JSON depth, message count and size: 400).

Admission on every generation route, in this order: auth + requests/min (401, 429), body checks,
session and history headers, tokens/min after tokenizing (429), then a slot on each chosen node, queued
by class (the key's, lowered by ``x-tandem-priority``) until the deadline (``x-tandem-deadline-ms`` or
``TANDEM_REQUEST_DEADLINE_S``): shed → 503 + Retry-After, code ``overloaded``/``shed``; expired → 503 +
Retry-After, code ``deadline_exceeded``, and no engine ever saw the request.

A client that disconnects cancels its request everywhere: one ``router.edge.exchange.Exchange`` owns each
generation request from admission to its record, and lets go of everything it held exactly once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Info, generate_latest
from pydantic import BaseModel, Field
from starlette.types import Receive, Scope, Send

from contracts.cluster import key as cluster_key
from contracts.cluster import prefix as cluster_prefix
from contracts.errors import (
    ConfigError,
    NotFound,
    PermissionDenied,
)
from contracts.registry import LiveNode, NodeRegistry, Role, registry_proof_key
from contracts.secret import curve_keys, engine_auth_headers, load_cluster_secret
from router.admission.context import AdmissionContext, AdmissionSettings
from router.admission.http import AdmissionDependencies
from router.admission.keys import Tenant
from router.admission.rejections import RejectedRecords
from router.background import TaskSet
from router.edge.api_document import install_document
from router.edge.codecs.routes import agent_router
from router.edge.codecs.store import ResponseStore
from router.edge.direct_write import RAW_SEND
from router.edge.exchange import GenerationRoute, parse_body
from router.edge.limits import BodyLimit
from router.edge.openai_errors import error_responses, install_error_handlers
from router.edge.schemas import JsonInt
from router.fleet import Fleet
from router.housekeeping import Housekeeping
from router.kv_index import CurveClient, FleetIndex, KVEventSubscribers
from router.model_table import ModelTable
from router.planning.cache_salt import CacheSalts
from router.planning.orchestrator import Orchestrator
from router.planning.peer_fetch import PeerFetch
from router.policies import CacheAware, LeastLoaded, RoundRobin, RoutingPolicy
from router.record.accounting import Accounting
from router.record.kv_activity import KVActivity
from router.record.metrics import RouterMetrics
from router.record.responses import ResponseIndex
from router.record.turns import TurnRecorder
from router.sessions.http import sessions_router
from router.settings import RouterSettings
from router.tokenizer import PromptTokenizer
from router.upstream.node_client import NodeClient
from telemetry import Emitter, EmitterConfig
from telemetry.batches import warm_batches
from telemetry.tracing import tracer_provider

T = TypeVar("T")

POLICIES = ("cache_aware", "least_loaded", "round_robin")


def make_policy(name: str, index: FleetIndex) -> RoutingPolicy:
    if name == "cache_aware":
        return CacheAware(index)
    if name == "least_loaded":
        return LeastLoaded()
    if name == "round_robin":
        return RoundRobin()
    raise ConfigError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")


class Feedback(BaseModel):
    """Bounded: feedback is stored with the request's record; a comment is a remark, not a document."""

    response_id: str = Field(min_length=1, max_length=128)
    rating: JsonInt = Field(ge=-1_000_000, le=1_000_000)
    comment: str | None = Field(default=None, max_length=4096)
    labels: list[Annotated[str, Field(max_length=64)]] = Field(default_factory=list, max_length=32)


class FeedbackRecorded(BaseModel):
    object: Literal["feedback"]
    response_id: str
    status: Literal["recorded"]


class Health(BaseModel):
    status: Literal["ok", "no_nodes"]
    nodes: dict[str, int]


def _redis_client(settings: RouterSettings) -> aioredis.Redis:
    """The registry's and the response index's Redis, with the admission clients' timeouts: a Redis that
    accepts and never answers fails each read (the fleet keeps its last view) instead of freezing it."""
    adm = settings.admission or AdmissionSettings(redis_url=settings.redis_url, cluster=settings.cluster)
    return aioredis.from_url(
        settings.redis_url,
        socket_timeout=adm.redis_socket_timeout_s,
        socket_connect_timeout=adm.redis_connect_timeout_s,
    )


def _export_admission(metrics: RouterMetrics, admission: AdmissionContext, fleet: Fleet) -> None:
    """Scrape-time views of admission: the per-node queues and the Redis content refused."""
    metrics.admission.source = admission.controller.snapshot
    metrics.registry.register(RejectedRecords(lambda: admission.keys.rejected, lambda: fleet.skipped_entries))


async def _any_key(ctx: AdmissionContext) -> bool:
    """Whether the key store holds a key (also sets Redis's auth flag from it)."""
    return await ctx.keys.refresh_flag()


def _kv_events_curve_client() -> CurveClient:
    """Keys for nodes that relay their KV events with CURVE (``node_agent.kv_events_relay``): from the
    cluster secret, which such nodes (on real interfaces) require to be set explicitly."""
    keys = curve_keys(load_cluster_secret(loopback_only=False))
    return CurveClient(keys.server_public, keys.client_public, keys.client_secret)


class RouterApp(FastAPI):
    """The router's app: keeps the server's own ``send`` in the scope, where the SSE relay finds it
    to write body chunks past the middlewares' send wrappers (``router.edge.direct_write``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(settings: RouterSettings | None = None) -> FastAPI:
    settings = settings or RouterSettings()
    metrics = RouterMetrics()
    Info("tandem_cluster", "The cluster this router serves (contracts.cluster).", registry=metrics.registry).info(
        {"cluster": settings.cluster}
    )
    # The fleet KV index exists whatever the policy: every request gets its hit-rate breakdown.
    index = FleetIndex()
    policy = make_policy(settings.policy, index)
    models_table = ModelTable.load(settings.models)  # a bad file stops the router here, not per request

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = _redis_client(settings)
        # The engines' API key derives from the cluster secret; the per-user default file is accepted here
        # (as for cache salts): nodes on other hosts need an explicit secret, which the router then shares.
        client = NodeClient(
            connect_timeout_s=settings.connect_timeout_s,
            request_timeout_s=settings.request_timeout_s,
            dead_after_s=settings.upstream_dead_after_s,
            auth_headers=engine_auth_headers(loopback_only=True),
        )
        emitter = activity = None
        if settings.telemetry:
            emitter = Emitter(
                EmitterConfig(
                    redis_url=settings.telemetry_redis_url or settings.redis_url,
                    stream_prefix=cluster_key(settings.cluster, "telemetry"),
                    source=f"router-{settings.port}",
                    journal_dir=settings.telemetry_journal_dir,
                ),
                metrics=metrics.common,
            )
            activity = KVActivity(emitter, lambda node_id: fleet.role_and_usage(node_id))
        subscribers = KVEventSubscribers(
            index, on_event=activity.observe if activity else None, curve_client=_kv_events_curve_client
        )
        fleet = Fleet(
            NodeRegistry(
                redis,
                cluster=settings.cluster,
                proof_key=registry_proof_key(load_cluster_secret(loopback_only=True), settings.cluster),
            ),
            refresh_s=settings.registry_refresh_s,
            on_refresh=subscribers.sync,
        )
        responses = ResponseIndex(redis, cluster_prefix(settings.cluster))
        admission = await AdmissionContext.create(
            settings.admission or AdmissionSettings(redis_url=settings.redis_url, cluster=settings.cluster)
        )
        if admission.settings.auth == "required" and not await _any_key(admission):
            await admission.close()
            raise ConfigError(
                "TANDEM_AUTH=required but the key store holds no API key (create one with "
                "`tandem keys create`, against the same TANDEM_DATABASE_URL / TANDEM_SQLITE_PATH)"
            )
        turns = TurnRecorder(admission)
        app.include_router(sessions_router(admission.sessions, AdmissionDependencies(admission)))
        housekeeping: Housekeeping = app.state.housekeeping
        await fleet.start(housekeeping)
        if activity is not None:
            activity.start(housekeeping)
        housekeeping.start()
        app.state.fleet, app.state.responses = fleet, responses
        app.state.response_store = ResponseStore(redis, cluster_prefix(settings.cluster))
        app.state.emitter = emitter
        app.state.admission = admission
        app.state.cache_salts = CacheSalts.from_cluster_secret(settings.shared_cache_tenants)
        app.state.kv_tasks = kv_tasks = TaskSet()
        spans = tracer_provider(settings.otlp_traces_endpoint)
        peers = PeerFetch(index, settings.peer_fetch_min_tokens) if settings.peer_fetch else None
        app.state.accounting = Accounting(
            metrics,
            emitter,
            responses,
            turns,
            spawn=kv_tasks.spawn,
            tracer=spans.get_tracer("tandem.router") if spans is not None else None,
            rates=peers.rates if peers is not None else None,
        )
        tokenizer = PromptTokenizer(render_timeout_s=settings.template_render_timeout_s)
        # Warm before serving: uvicorn listens only after the lifespan has started.
        await tokenizer.warm([*settings.warm_models, *(n.info.model_path or "" for n in fleet.nodes)])
        await asyncio.to_thread(warm_batches)  # pyarrow's first rows import pandas: not on a request's time
        app.state.orchestrator = Orchestrator(
            settings,
            fleet,
            client,
            policy,
            tokenizer,
            metrics,
            index,
            slots=admission.controller,
            models=models_table,
            peers=peers,
        )
        _export_admission(metrics, admission, fleet)
        app.state.index, app.state.subscribers = index, subscribers
        try:
            yield
        finally:
            await housekeeping.stop()
            await fleet.stop()
            await subscribers.close()
            if activity is not None:
                activity.stop()
            await client.aclose()
            await responses.drain()
            await turns.drain()
            await kv_tasks.drain()
            await admission.close()
            if emitter is not None:
                await emitter.aclose()
            if spans is not None:
                await asyncio.to_thread(spans.shutdown)  # exports what is batched
            await redis.aclose()

    # The document and its viewers are routes of ours (below), not FastAPI's open ones: they follow the
    # API's own auth rule, and the document says what the server does in the auth mode it is in.
    app = RouterApp(
        title="Tandem router", version="0.1.0", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None
    )
    app.state.settings = settings
    app.state.metrics = metrics
    # The router's one periodic loop: fleet refresh, KV activity rows, the server's Date header.
    app.state.housekeeping = Housekeeping()
    install_error_handlers(app)
    app.add_middleware(BodyLimit, **BodyLimit.settings_of(settings))

    async def tenant_of(request: Request, *, admin: bool = False) -> Tenant:
        """The request's tenant (401 while auth is on and the key is missing or bad); with ``admin``,
        403 unless the key is an admin key (or auth is off)."""
        tenant = await request.app.state.admission.gate.authenticate(request.headers.get("authorization"))
        if admin and not tenant.may_administer:
            raise PermissionDenied("this route needs an admin key (`tandem keys create --admin`)")
        return tenant

    # The generation routes are plain ASGI apps: each request is one ``Exchange`` that owns its whole
    # life, the sending of the answer included (router.edge.exchange).
    app.router.add_route("/v1/chat/completions", GenerationRoute("chat", "chat"), methods=["POST"])
    app.router.add_route("/v1/completions", GenerationRoute("completion", "completions"), methods=["POST"])
    # Responses and Messages: decoded at the edge into the same chat request (router.edge.codecs.intake).
    app.router.add_route("/v1/responses", GenerationRoute("chat", "responses", "responses"), methods=["POST"])
    app.router.add_route("/v1/messages", GenerationRoute("chat", "messages", "messages"), methods=["POST"])
    app.include_router(agent_router())

    install_document(app, tenant_of, Feedback)

    @app.post(
        "/v1/feedback",
        status_code=202,
        responses={
            202: {"model": FeedbackRecorded, "description": "Recorded with the response's record"},
            **error_responses(400, 401, 404, 413, 422),
        },
    )
    async def feedback(request: Request) -> JSONResponse:
        tenant = await tenant_of(request)
        fb: Feedback = await parse_body(request, Feedback)
        ref = await request.app.state.responses.lookup(fb.response_id)
        if ref.tenant_id != tenant.tenant_id:
            # As if it did not exist: another tenant's response ids are not even confirmed.
            raise NotFound(f"No response with id `{fb.response_id}`.", param="response_id")
        emitter: Emitter | None = request.app.state.emitter
        if emitter is not None:
            emitter.emit(
                "feedback",
                {
                    "response_id": fb.response_id,
                    "request_id": ref.request_id,
                    "session_id": ref.session_id,
                    "tenant_id": ref.tenant_id,
                    "rating": fb.rating,
                    "comment": fb.comment,
                    "labels": fb.labels,
                },
            )
        return JSONResponse(
            {"object": "feedback", "response_id": fb.response_id, "status": "recorded"}, status_code=202
        )

    @app.get("/v1/models", responses=error_responses(401))
    async def models(request: Request) -> dict[str, Any]:
        """Every served model with a live node, then every alias and canary name (``router.model_table``)
        one of whose served models has a live node; ``parent`` names what a public name stands for (an
        alias's target, a canary's heaviest served name; vLLM's field for a model built on another),
        null for a served model."""
        await tenant_of(request)
        fleet: Fleet = request.app.state.fleet
        served = fleet.models()

        def card(name: str, n: LiveNode, parent: str | None) -> dict[str, Any]:
            started = datetime.fromtimestamp(n.info.started_at, tz=UTC)
            return {
                "id": name,
                "object": "model",
                # Anthropic's model card too (Claude Code lists models with the anthropic SDK).
                "type": "model",
                "display_name": name,
                "created_at": started.isoformat().replace("+00:00", "Z"),
                "created": int(n.info.started_at),
                "owned_by": "tandem",
                "root": n.info.model,
                "parent": parent,
                "max_model_len": n.info.max_model_len,
            }

        data = [card(name, n, None) for name, n in sorted(served.items())]
        for public in models_table.public_names:
            live = [t for t in models_table.targets(public) if t in served]
            if live and public not in served:
                data.append(card(public, served[live[0]], models_table.parent(public)))
        # OpenAI's list, with Anthropic's paging fields (one page holds every model).
        return {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    @app.get(
        "/health",
        response_model=Health,
        responses={503: {"model": Health, "description": "No node can serve (none is live)"}},
    )
    async def health(request: Request) -> JSONResponse:
        fleet: Fleet = request.app.state.fleet
        roles = {r.value: sum(1 for n in fleet.nodes if n.info.role is r) for r in Role}
        serving = any(roles.values())  # with every decode node gone, prefill nodes serve whole requests
        return JSONResponse(
            {"status": "ok" if serving else "no_nodes", "nodes": roles}, status_code=200 if serving else 503
        )

    @app.get("/cluster", responses=error_responses(401, 403))
    async def cluster(request: Request) -> dict[str, Any]:
        """Admin view: every live node with its role, load, KV usage, cached blocks in the router's
        index and its KV-event stream health."""
        await tenant_of(request, admin=True)
        fleet: Fleet = request.app.state.fleet
        blocks = {
            node: n for per_model in request.app.state.index.block_counts().values() for node, n in per_model.items()
        }
        events = request.app.state.subscribers.stats()
        nodes = []
        for n in sorted(fleet.nodes, key=lambda n: (n.info.role.value, n.info.node_id)):
            st = events.get(n.info.node_id)
            nodes.append(
                {
                    "node_id": n.info.node_id,
                    "role": n.info.role.value,
                    "model": n.info.model,
                    "url": n.info.url,
                    "running": n.load.running,
                    "waiting": n.load.waiting,
                    "kv_usage": n.load.kv_usage,
                    "num_kv_blocks": n.info.num_kv_blocks,
                    "block_size": n.info.block_size,
                    "cached_blocks": blocks.get(n.info.node_id, 0),
                    "router_inflight": fleet.inflight(n.info.node_id),
                    "kv_events": {
                        "applied_batches": st.applied_batches,
                        "gaps": st.gaps,
                        "lost": st.lost,
                        "key_mismatches": st.key_mismatches,
                    }
                    if st
                    else None,
                }
            )
        return {"object": "cluster", "cluster": settings.cluster, "policy": settings.policy, "nodes": nodes}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text exposition format"}, **error_responses(401, 403)},
    )
    async def prometheus(request: Request) -> Response:
        await tenant_of(request, admin=True)
        fleet: Fleet = request.app.state.fleet
        metrics.live_nodes.clear()
        for role in Role:
            metrics.live_nodes.labels(role.value).set(sum(1 for n in fleet.nodes if n.info.role is role))
        for n in fleet.nodes:
            labels = (n.info.node_id, n.info.role.value)
            metrics.inflight.labels(*labels).set(fleet.inflight(n.info.node_id))
            metrics.kv_usage.labels(*labels).set(n.load.kv_usage)
            metrics.common.set_node_load(*labels, waiting=n.load.waiting, running=n.load.running)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
