"""Settings and the one object that owns the admission and session machinery of a router process.

``AdmissionSettings`` is the router's admission section (``RouterSettings.admission``): its variables
keep the names users know, ``TANDEM_<FIELD>`` (``ENV_PREFIX``), but for the node slots, which say whose
they are (``TANDEM_ROUTER_NODE_*``; the old ``TANDEM_NODE_*`` names are still read). ``tandem keys``,
which runs no router, reads the same section with ``from_env``. ``AdmissionContext`` is built from it
once at start-up (``await AdmissionContext.create(settings)``), passed to whatever needs it (HTTP
dependencies, the sessions router, the CLI) and closed at shutdown. Nothing is module-global.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import redis.asyncio as aioredis
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from contracts.cluster import DEFAULT_CLUSTER
from contracts.cluster import prefix as cluster_prefix
from contracts.config import DEFAULT_REDIS_URL, section_env
from router.admission.concurrency import TenantStreams
from router.admission.keys import ANONYMOUS_TENANT, KeyStore, Tenant
from router.admission.priority import AdmissionController
from router.admission.ratelimit import ClockMs, Gatekeeper, GlobalLimits
from router.sessions.sql import Database, open_database
from router.sessions.store import RegionCache, SessionStore


class AdmissionSettings(BaseModel):
    """Admission, keys, limits and sessions. Every field is ``TANDEM_<NAME>`` in the environment but the
    node slots (``TANDEM_ROUTER_NODE_*``); in a router, ``redis_url`` and ``cluster`` are the router's."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)
    ENV_PREFIX: ClassVar[str] = "TANDEM_"

    redis_url: str = DEFAULT_REDIS_URL
    """Redis for keys and rate limits (shared by all regions' routers), and the home region's session
    cache unless ``region_cache_urls`` names one."""
    cluster: str = DEFAULT_CLUSTER
    """``TANDEM_CLUSTER``: the cluster these keys, limits and sessions belong to (``contracts.cluster``)."""
    key_prefix: str = ""
    """Prefix of every Redis key written here; empty: the cluster's (``tandem:`` for ``default``)."""
    database_url: str | None = None
    """``postgresql://user@host:port/db`` (optionally ``?schema=name``); None → SQLite at ``sqlite_path``."""
    sqlite_path: Path = Path(".tandem/tandem.db")
    region: str = "local"
    """This router's region: its session cache is ``region_cache_urls[region]`` (else ``redis_url``)."""
    region_cache_urls: dict[str, str] = Field(default_factory=dict)
    """Every region's session-cache Redis, as JSON: ``{"a": "redis://...:6379/4", "b": ".../5"}``.
    Other regions' caches receive hot sessions' new turns and ``DELETE``s."""

    auth: Literal["auto", "required"] = "auto"
    """auto: no auth until the first API key exists, then always; required: always."""
    anonymous_rpm: int = 0
    """Requests/min for the ``anonymous`` tenant while auth is off; 0 = unlimited."""
    anonymous_tpm: int = 0
    global_rpm: int = 0
    """Requests/min over all tenants; 0 = unlimited."""
    global_tpm: int = 0
    """Tokens/min over all tenants; 0 = unlimited."""
    completion_reserve_tokens: int = 256
    """Tokens reserved at admission for the completion when the request has no ``max_tokens``."""
    default_rpm: int = 600
    """Limits given to a tenant created by ``tandem keys create`` without --rpm / --tpm."""
    default_tpm: int = 1_000_000
    negative_key_ttl_s: float = 10.0
    """How long an unknown key is remembered as unknown in Redis (spares the store)."""
    store_outage_grace_s: float = 60.0
    """While Redis (or the key store) cannot be reached, a key Redis confirmed within this many seconds
    is still served, as is everyone while auth was off that recently (or, for a router that served nobody
    that recently, while the key store itself holds no key), with no rate limit charged; other keys get
    503 + Retry-After. So a Redis restart is no outage, and a key revoked during one works for at
    most this long (otherwise revocation is immediate). 0: refuse everything (503) while the store is
    unreachable."""

    auth_off_lease_s: float = Field(default=1.0, ge=0)
    """While auth is off and no anonymous or global limit is set, how long a router reuses Redis' "auth
    off" answer without asking again (``router.admission.auth_off``): a key created elsewhere turns
    auth on within this long on every router, and at once on routers its announcement reaches (all
    of them, while Redis is up). 0: ask Redis on every request."""

    tenant_max_streams: int = 0
    """Generation requests (streamed or not) one tenant may have in flight at once through one router
    process (``router.admission.concurrency``); one more is a 429 ``rate_limit_exceeded``. 0 = unlimited.
    With several router replicas a tenant may hold this many on each."""
    tenant_max_streams_overrides: dict[str, int] = Field(default_factory=dict)
    """Per-tenant exceptions to ``tenant_max_streams``, as JSON: ``{"acme": 100, "batch-team": 0}``."""

    node_max_concurrency: int = Field(
        default=64, validation_alias=AliasChoices("TANDEM_ROUTER_NODE_MAX_CONCURRENCY", "TANDEM_NODE_MAX_CONCURRENCY")
    )
    """Requests one router sends to one node at once (a P/D request holds a slot on its decode node for
    the whole answer and one on its prefill node for the prefill leg); the rest queue by class then
    arrival. Set it near the engine's batch capacity (vLLM ``max_num_seqs``), so that the engine never
    queues FIFO what the router could have ordered by class, yet batches fully."""
    node_max_queue: int = Field(
        default=256, validation_alias=AliasChoices("TANDEM_ROUTER_NODE_MAX_QUEUE", "TANDEM_NODE_MAX_QUEUE")
    )
    """Queued requests per node beyond which batch (then interactive) requests are shed with 503."""
    request_deadline_s: float = 30.0
    """Default time budget, from arrival at the router, for a request to get its node slots; a request
    still queued when it passes is dropped unserved (503 ``deadline_exceeded``). A client sets its own
    with ``x-tandem-deadline-ms``."""

    database_command_timeout_s: float = 5.0
    """Longest one PostgreSQL statement may run (asyncpg ``command_timeout``; the statement is cancelled
    on the server). Past it the caller gets ``StoreTimeout``: key lookups, session reads and writes
    fail in bounded time while the database hangs."""
    database_connect_timeout_s: float = 5.0
    """Longest connecting to PostgreSQL, or waiting for a pooled connection, may take."""
    redis_socket_timeout_s: float = 2.0
    """Longest one Redis command may wait for its answer, on every client built here (keys, rate
    limits, session caches). Past it: ``redis.TimeoutError``, which the callers treat as Redis down
    (session reads fall back to the store). No client here uses blocking commands."""
    redis_connect_timeout_s: float = 2.0
    """Longest connecting to Redis may take."""

    session_cache_ttl_s: float = 86_400.0
    session_max_cached_turns: int = 500
    """Sessions longer than this are read from the store on every read instead of cached."""
    session_queue_size: int = 10_000
    """Turns waiting for the background writer; beyond it, turns are dropped and counted."""

    @classmethod
    def from_env(cls) -> AdmissionSettings:
        """The section as the environment sets it, for a process without a router (``tandem keys``)."""
        return cls.model_validate(section_env(cls, cls.ENV_PREFIX))


@dataclass
class AdmissionContext:
    settings: AdmissionSettings
    redis: aioredis.Redis
    region_caches: dict[str, aioredis.Redis]
    db: Database
    keys: KeyStore
    gate: Gatekeeper
    controller: AdmissionController
    sessions: SessionStore
    streams: TenantStreams
    closed: bool = False

    @classmethod
    async def create(
        cls, settings: AdmissionSettings, *, clock_ms: ClockMs | None = None, start_writer: bool = True
    ) -> AdmissionContext:
        """Connect Redis and the store, create tables if missing, start the session writer."""
        timeouts = {
            "socket_timeout": settings.redis_socket_timeout_s,
            "socket_connect_timeout": settings.redis_connect_timeout_s,
        }
        redis = aioredis.Redis.from_url(settings.redis_url, **timeouts)
        caches = {name: aioredis.Redis.from_url(url, **timeouts) for name, url in settings.region_cache_urls.items()}
        home_redis = caches.get(settings.region, redis)
        db = await open_database(
            settings.database_url or str(settings.sqlite_path),
            command_timeout_s=settings.database_command_timeout_s,
            connect_timeout_s=settings.database_connect_timeout_s,
        )
        keys = KeyStore(
            redis,
            db,
            prefix=settings.key_prefix or cluster_prefix(settings.cluster),
            require_auth=settings.auth == "required",
            anonymous=Tenant(tenant_id=ANONYMOUS_TENANT, rpm=settings.anonymous_rpm, tpm=settings.anonymous_tpm),
            negative_ttl_s=settings.negative_key_ttl_s,
            outage_grace_s=settings.store_outage_grace_s,
            auth_off_lease_s=settings.auth_off_lease_s,
        )
        gate = Gatekeeper(
            redis,
            keys,
            global_limits=GlobalLimits(rpm=settings.global_rpm, tpm=settings.global_tpm),
            completion_reserve_tokens=settings.completion_reserve_tokens,
            clock_ms=clock_ms,
        )
        sessions = SessionStore(
            db,
            RegionCache(settings.region, home_redis),
            [RegionCache(name, r) for name, r in caches.items() if name != settings.region],
            prefix=settings.key_prefix or cluster_prefix(settings.cluster),
            cache_ttl_s=settings.session_cache_ttl_s,
            max_cached_turns=settings.session_max_cached_turns,
            queue_size=settings.session_queue_size,
        )
        ctx = cls(
            settings=settings,
            redis=redis,
            region_caches=caches,
            db=db,
            keys=keys,
            gate=gate,
            controller=AdmissionController(
                max_concurrency=settings.node_max_concurrency, max_queue=settings.node_max_queue
            ),
            sessions=sessions,
            streams=TenantStreams(settings.tenant_max_streams, settings.tenant_max_streams_overrides),
        )
        try:
            await keys.init_schema()
            await sessions.init_schema()
        except BaseException:
            await ctx.close()
            raise
        if start_writer:
            sessions.start()
        return ctx

    async def close(self) -> None:
        """Stop listening for created keys, drain the session writer, then close connections. Idempotent."""
        if self.closed:
            return
        self.closed = True
        await self.keys.auth_off.aclose()
        await self.sessions.close()
        await self.db.close()
        for r in {id(r): r for r in (self.redis, *self.region_caches.values())}.values():
            await r.aclose()
