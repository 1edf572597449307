"""The router process's services: every long-lived resource, opened by one async context manager.

``open_services(settings)`` opens them on one ``AsyncExitStack``, each resource's close registered right
after the resource exists, and yields a frozen ``Services``. However the start ends (a Redis that
refuses, ``TANDEM_AUTH=required`` with no key, a tokenizer that fails to warm) and however the process
stops, exactly what was opened is closed, in the reverse order of its opening, and a close that raises
does not skip the closes after it (the stack runs every one and re-raises the first error). The order
of opening is therefore the order of shutdown read backwards:

    opened                                  closed (at stop, or when a later step fails)
    Redis client (registry, responses)      last: every close before it may still write to Redis
    span exporter (OTLP), when configured   exports what is batched
    telemetry emitter, when on              flushes the records of the closes before it
    admission (keys, limits, sessions)      stops listening for created keys (``router.admission.auth_off``),
                                            drains the session writer, closes the store
    background tasks (``TaskSet``)          drained: nothing started is dropped
    turn recorder                           drained
    response index                          drained
    node client (HTTP to the engines)       closed once no request can use it
    KV activity rows, when telemetry is on  its last interval flushed
    KV-event subscribers                    sockets closed
    fleet (registry reads)                  its refresh job removed
    housekeeping loop                       first: no periodic job runs while the rest closes

The rest (the orchestrator, accounting, cache salts, the response store) holds no resource of its own
and is built last, after the tokenizers are warm (uvicorn listens only once the start is done).

``Services`` is what the routes are handed (``router.edge.app``): typed attributes, one object, built once;
no component looks another up by name at request time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import redis.asyncio as aioredis
from fastapi import FastAPI
from prometheus_client import Info
from starlette.requests import HTTPConnection
from starlette.types import Receive, Scope, Send

from contracts.cluster import key as cluster_key
from contracts.cluster import prefix as cluster_prefix
from contracts.errors import ConfigError
from contracts.registry import NodeRegistry, registry_proof_key
from contracts.secret import curve_keys, engine_auth_headers, load_cluster_secret
from router.admission.context import AdmissionContext
from router.admission.rejections import RejectedRecords
from router.background import TaskSet
from router.edge.codecs.store import ResponseStore
from router.edge.direct_write import RAW_SEND
from router.fleet import Fleet
from router.housekeeping import DEFAULT_TICK_S, Housekeeping
from router.kv_index import CurveClient, FleetIndex, KVEventSubscribers
from router.model_table import ModelTable
from router.planning.cache_salt import CacheSalts
from router.planning.orchestrator import Orchestrator
from router.planning.peer_fetch import PeerFetch, serves_peers
from router.planning.split_prefill import SplitPrefill
from router.policies import CacheAware, LeastLoaded, PeerReach, PolicyName, RoundRobin, RoutingPolicy
from router.record.accounting import Accounting
from router.record.kv_activity import KVActivity
from router.record.metrics import RouterMetrics
from router.record.responses import ResponseIndex
from router.record.turns import TurnRecorder
from router.settings import RouterSettings
from router.tokenizer import PromptTokenizer
from router.upstream.node_client import NodeClient
from telemetry import Emitter, EmitterConfig
from telemetry.batches import warm_batches
from telemetry.tracing import tracer_provider

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


@dataclass(frozen=True, slots=True)
class Services:
    """Everything a route may use, open for the life of the process (see the module docstring)."""

    settings: RouterSettings
    metrics: RouterMetrics
    housekeeping: Housekeeping
    """The router's one periodic loop: fleet refresh, KV activity rows, the server's Date header."""
    index: FleetIndex
    subscribers: KVEventSubscribers
    fleet: Fleet
    models: ModelTable
    admission: AdmissionContext
    responses: ResponseIndex
    response_store: ResponseStore
    emitter: Emitter | None
    cache_salts: CacheSalts
    kv_tasks: TaskSet
    accounting: Accounting
    orchestrator: Orchestrator


class RouterApp(FastAPI):
    """The router's app: keeps the server's own ``send`` in the scope, where the SSE relay finds it to
    write body chunks past the middlewares' send wrappers (``router.edge.direct_write``), and holds the
    ``Services`` its lifespan opened (``router.edge.app``)."""

    _services: Services | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)

    @property
    def services(self) -> Services:
        if self._services is None:
            raise RuntimeError("the router's services are not open: its lifespan has not started")
        return self._services

    def serve_with(self, services: Services) -> None:
        """What the routes use from now on (the lifespan's start; each start opens its own)."""
        self._services = services


def services_of(conn: HTTPConnection) -> Services:
    """The open ``Services`` of the app serving ``conn``: the routes' typed dependency."""
    return cast(RouterApp, conn.app).services


def make_policy(settings: RouterSettings, index: FleetIndex) -> RoutingPolicy:
    """The routing policy the settings name (one per ``PolicyName``); cache_aware counts what a peer fetch
    would load where both ``peer_reach`` and ``peer_fetch`` are on (a reach no fetch follows would send a
    session to a node that then computes its context)."""
    name = settings.policy
    if name is PolicyName.CACHE_AWARE:
        reach = settings.peer_reach and settings.peer_fetch
        return CacheAware(index, peer_reach=PeerReach(index.own_prefix, serves_peers) if reach else None)
    if name is PolicyName.LEAST_LOADED:
        return LeastLoaded()
    return RoundRobin()


def _redis_client(settings: RouterSettings) -> aioredis.Redis:
    """The registry's and the response index's Redis, with the admission clients' timeouts: a Redis that
    accepts and never answers fails each read (the fleet keeps its last view) instead of freezing it."""
    adm = settings.admission
    return aioredis.from_url(
        settings.redis_url,
        socket_timeout=adm.redis_socket_timeout_s,
        socket_connect_timeout=adm.redis_connect_timeout_s,
    )


def _kv_events_curve_client() -> CurveClient:
    """Keys for nodes that relay their KV events with CURVE (``node_agent.kv_events_relay``): from the
    cluster secret, which such nodes (on real interfaces) require to be set explicitly."""
    keys = curve_keys(load_cluster_secret(loopback_only=False))
    return CurveClient(keys.server_public, keys.client_public, keys.client_secret)


async def _open_admission(stack: AsyncExitStack, settings: RouterSettings) -> AdmissionContext:
    admission = await AdmissionContext.create(settings.admission)
    stack.push_async_callback(admission.close)
    admission.keys.auth_off.listen(admission.redis)  # stopped by admission.close
    if admission.settings.auth == "required" and not await admission.keys.refresh_flag():
        raise ConfigError(
            "TANDEM_AUTH=required but the key store holds no API key (create one with "
            "`tandem keys create`, against the same TANDEM_DATABASE_URL / TANDEM_SQLITE_PATH)"
        )
    return admission


def _open_emitter(stack: AsyncExitStack, settings: RouterSettings, metrics: RouterMetrics) -> Emitter | None:
    if not settings.telemetry:
        return None
    emitter = Emitter(
        EmitterConfig(
            redis_url=settings.telemetry_redis_url or settings.redis_url,
            stream_prefix=cluster_key(settings.cluster, "telemetry"),
            source=f"router-{settings.port}",
            journal_dir=settings.telemetry_journal_dir,
            flush_interval_s=settings.telemetry_flush_s,
        ),
        metrics=metrics.common,
    )
    stack.push_async_callback(emitter.aclose)
    return emitter


@dataclass(frozen=True, slots=True)
class _Stores:
    """What the first half of the start opens: the stores and the writers to them."""

    redis: aioredis.Redis
    spans: TracerProvider | None
    emitter: Emitter | None
    admission: AdmissionContext
    kv_tasks: TaskSet
    turns: TurnRecorder
    responses: ResponseIndex


async def _open_stores(stack: AsyncExitStack, settings: RouterSettings, metrics: RouterMetrics) -> _Stores:
    redis = _redis_client(settings)
    stack.push_async_callback(redis.aclose)
    spans = tracer_provider(settings.otlp_traces_endpoint)
    if spans is not None:
        stack.push_async_callback(asyncio.to_thread, spans.shutdown)  # exports what is batched
    emitter = _open_emitter(stack, settings, metrics)
    admission = await _open_admission(stack, settings)
    kv_tasks = TaskSet()
    stack.push_async_callback(kv_tasks.drain)
    turns = TurnRecorder(admission)
    stack.push_async_callback(turns.drain)
    responses = ResponseIndex(redis, cluster_prefix(settings.cluster))
    stack.push_async_callback(responses.drain)
    return _Stores(redis, spans, emitter, admission, kv_tasks, turns, responses)


async def _open_fleet(
    stack: AsyncExitStack, settings: RouterSettings, redis: aioredis.Redis, index: FleetIndex, emitter: Emitter | None
) -> tuple[Fleet, KVEventSubscribers, Housekeeping]:
    """The live-node view and the KV events of its nodes, refreshed by the started housekeeping loop."""
    fleet_ref: list[Fleet] = []  # the activity rows name a node's role, which the fleet (below) knows
    activity = KVActivity(emitter, lambda node: fleet_ref[0].role_and_usage(node)) if emitter is not None else None
    if activity is not None:
        stack.callback(activity.stop)
    subscribers = KVEventSubscribers(
        index, on_event=activity.observe if activity else None, curve_client=_kv_events_curve_client
    )
    stack.push_async_callback(subscribers.close)
    proof = registry_proof_key(load_cluster_secret(loopback_only=True), settings.cluster)
    fleet = Fleet(
        NodeRegistry(redis, cluster=settings.cluster, proof_key=proof),
        refresh_s=settings.registry_refresh_s,
        on_refresh=subscribers.sync,
    )
    fleet_ref.append(fleet)
    stack.push_async_callback(fleet.stop)
    housekeeping = Housekeeping(tick_s=min(DEFAULT_TICK_S, settings.registry_refresh_s))
    stack.push_async_callback(housekeeping.stop)
    await fleet.start(housekeeping)
    if activity is not None:
        activity.start(housekeeping)
    housekeeping.start()
    return fleet, subscribers, housekeeping


def _node_client(settings: RouterSettings) -> NodeClient:
    # The engines' API key derives from the cluster secret; the per-user default file is accepted here
    # (as for cache salts): nodes on other hosts need an explicit secret, which the router then shares.
    return NodeClient(
        connect_timeout_s=settings.connect_timeout_s,
        request_timeout_s=settings.request_timeout_s,
        dead_after_s=settings.upstream_dead_after_s,
        auth_headers=engine_auth_headers(loopback_only=True),
    )


@asynccontextmanager
async def open_services(settings: RouterSettings) -> AsyncIterator[Services]:
    """Open the router's resources in the order of the module docstring; close them in reverse."""
    metrics = RouterMetrics()
    Info("tandem_cluster", "The cluster this router serves (contracts.cluster).", registry=metrics.registry).info(
        {"cluster": settings.cluster}
    )
    index = FleetIndex()  # whatever the policy: every request gets its hit-rate breakdown
    models = ModelTable.load(settings.models)  # a bad file stops the router here, not per request
    async with AsyncExitStack() as stack:
        st = await _open_stores(stack, settings, metrics)
        client = _node_client(settings)
        stack.push_async_callback(client.aclose)
        fleet, subscribers, housekeeping = await _open_fleet(stack, settings, st.redis, index, st.emitter)
        peers = PeerFetch(index, settings.peer_fetch_min_tokens) if settings.peer_fetch else None
        splits = SplitPrefill(index, settings.split_prefill_min_tokens) if settings.split_prefill else None
        accounting = Accounting(
            metrics,
            st.emitter,
            st.responses,
            st.turns,
            spawn=st.kv_tasks.spawn,
            tracer=st.spans.get_tracer("tandem.router") if st.spans is not None else None,
            rates=peers.rates if peers is not None else None,
        )
        tokenizer = PromptTokenizer(render_timeout_s=settings.template_render_timeout_s)
        # Warm before serving: uvicorn listens only after the start is done.
        await tokenizer.warm([*settings.warm_models, *(n.info.model_path or "" for n in fleet.nodes)])
        await asyncio.to_thread(warm_batches)  # pyarrow's first rows import pandas: not on a request's time
        policy = make_policy(settings, index)
        orchestrator = Orchestrator(
            settings,
            fleet,
            client,
            policy,
            tokenizer,
            metrics,
            index,
            slots=st.admission.controller,
            models=models,
            peers=peers,
            splits=splits,
        )
        # Scrape-time views of admission: the per-node queues and the Redis content refused.
        metrics.admission.source = st.admission.controller.snapshot
        rejected = RejectedRecords(lambda: st.admission.keys.rejected, lambda: fleet.skipped_entries)
        metrics.registry.register(rejected)
        yield Services(
            settings=settings,
            metrics=metrics,
            housekeeping=housekeeping,
            index=index,
            subscribers=subscribers,
            fleet=fleet,
            models=models,
            admission=st.admission,
            responses=st.responses,
            response_store=ResponseStore(st.redis, cluster_prefix(settings.cluster)),
            emitter=st.emitter,
            cache_salts=CacheSalts.from_cluster_secret(settings.shared_cache_tenants),
            kv_tasks=st.kv_tasks,
            accounting=accounting,
            orchestrator=orchestrator,
        )
