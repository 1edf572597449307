"""Settings of the router process: one typed object, built once at start-up and passed down.

``RouterSettings`` is the root: its own fields are ``TANDEM_ROUTER_<FIELD>`` (the HTTP edge, planning,
upstream, records), but the Redis URL and the cluster name, which are every process's
(``TANDEM_REDIS_URL``, ``TANDEM_CLUSTER``, ``contracts.config``). Its ``admission`` section
(``router.admission.context.AdmissionSettings``: keys, limits, sessions, node slots) is read from the
environment under its own names in the same build (``settings_customise_sources``), so one object holds
everything the process was told and each component is handed its part: ``AdmissionContext`` the
section, the rest the root. The section's Redis URL and cluster are the root's (a ``--redis-url`` moves
both), unless a caller hands a section of its own.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from contracts.cluster import CLUSTER_ENV, DEFAULT_CLUSTER, NAME_PATTERN
from contracts.config import DEFAULT_REDIS_URL, REDIS_URL_ENV, section_env
from router.admission.context import AdmissionSettings
from router.policies import PolicyName
from telemetry.priority import CpuPriority


class FallbackPolicy(enum.StrEnum):
    """What to do when the prefill leg fails for a reason that is not the client's (node died,
    connection refused, 5xx): like vLLM's kv_load_failure_policy, an explicit choice."""

    LOCAL = "local"  # prefill on the decode node instead (no transfer); the client never notices
    ERROR = "error"  # return a 502 to the client


_SHARED = {"redis_url": REDIS_URL_ENV, "cluster": CLUSTER_ENV}
"""The root's fields its admission section shares, with the variable each is read from."""


class _AdmissionEnv(PydanticBaseSettingsSource):
    """The ``admission`` section's variables, under their own names (``AdmissionSettings.ENV_PREFIX``)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: ``__call__`` reads the whole section at once

    def __call__(self) -> dict[str, Any]:
        values = section_env(AdmissionSettings, AdmissionSettings.ENV_PREFIX, skip=frozenset(_SHARED))
        return {"admission": values} if values else {}


class RouterSettings(BaseSettings):
    """Every field can also come from the environment as ``TANDEM_ROUTER_<FIELD>``, but the Redis URL,
    which is every process's ``TANDEM_REDIS_URL`` (``contracts.config``)."""

    model_config = SettingsConfigDict(
        env_prefix="TANDEM_ROUTER_", frozen=True, validate_by_name=True, validate_by_alias=True
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _AdmissionEnv(settings_cls), dotenv_settings, file_secret_settings

    @model_validator(mode="before")
    @classmethod
    def _section_shares_the_root(cls, data: Any) -> Any:
        """The admission section's Redis URL and cluster are the root's, unless the section was handed
        in whole or names them itself (an input rule, before validation: nothing is filled in after)."""
        if not isinstance(data, dict) or isinstance(data.get("admission"), AdmissionSettings):
            return data
        section = dict(data.get("admission") or {})
        for name, env in _SHARED.items():
            root = data.get(name, data.get(env))
            if root is not None:
                section.setdefault(name, root)
        return {**data, "admission": section}

    host: str = "127.0.0.1"
    port: int = 8000
    reuse_port: bool = False
    """Bind with SO_REUSEPORT, so several router replicas on one host share ``port``: the kernel spreads
    new connections over the live ones, and a replica that dies takes only its own streams with it
    (``tandem up`` runs two). Linux only lets processes of the same user share a port this way."""
    redis_url: str = Field(default=DEFAULT_REDIS_URL, validation_alias=REDIS_URL_ENV)
    cluster: str = Field(default=DEFAULT_CLUSTER, validation_alias=CLUSTER_ENV, pattern=NAME_PATTERN)
    """Name of the cluster this process belongs to (``TANDEM_CLUSTER``, set by ``tandem up --cluster``):
    every Redis key and host path it uses is under it (``contracts.cluster``)."""
    policy: PolicyName = PolicyName.CACHE_AWARE
    """cache_aware (default), least_loaded or round_robin (router.policies)."""
    models: Path | None = None
    """Models file (TOML, ``router.model_table``): aliases, a fallback per served model, canary weights
    between served names behind one public name. None (the default): every request's ``model`` is a
    served name, routed as it is. Read once at start-up; a bad file stops the router (``ConfigError``)."""
    warm_models: list[str] = Field(default_factory=list)
    """Model folders whose tokenizer the router loads, and renders a chat with, before it serves
    (``PromptTokenizer.warm``), beside those of the nodes registered when it starts; ``tandem up``
    names its nodes' models. A router on another host than the folders skips them."""
    registry_refresh_s: float = Field(default=2.0, gt=0)
    """How often the live-node view is re-read from Redis. Nodes heartbeat their load every 2 s, so a
    faster refresh buys no fresher loads, only idle CPU taken from the engines on a shared host (each
    refresh is a wake-up of the router and a Redis round trip: ``router.housekeeping``). A node that
    joins is routed to within this; one that dies leaves at its first failed leg, or with its entry."""
    prefill_fallback: FallbackPolicy = FallbackPolicy.LOCAL
    layerwise: bool = True
    """Send a P/D pair's two legs at once (``router.planning.layerwise``): the decode node pulls each layer while
    the prefill node computes it, so the transfer adds about one layer after the prefill instead of the
    whole prompt's KV. Used only where both nodes run our connector and the prefill node advertises its
    block server (registry schema 3); off: every pair is sequential (prefill, then a whole pull)."""
    peer_fetch: bool = True
    """Cross-node prefix reuse (``router.planning.peer_fetch``): when the node that serves a request lacks a prefix
    a peer's engine holds, it loads those blocks from the peer instead of computing them, if the measured
    rates say that is faster (never otherwise). Only between colocated nodes that run our connector
    (``tandem up --peer-kv``): nothing changes elsewhere."""
    peer_reach: bool = True
    """``cache_aware`` counts, for a colocated node that serves peers, the blocks a peer's engine holds past
    its own (what a peer fetch would load there), as it counts a host tier's: a node that could fetch a
    context ties with the one holding it and the lighter load wins (``router.policies.cache_aware``).
    Needs ``peer_fetch``; nothing changes where no two nodes serve peers. On because ``bench fleet``
    measured it (``docs/bench/fleet.md``: at two nodes it levels the defaults with the tier arm, whose
    lead was this balance)."""
    peer_fetch_min_tokens: int = Field(default=256, ge=1)
    """The least a fetch must save (prompt tokens) to be worth the round trip to the peer."""
    split_prefill: bool = True
    """Split prefill (``router.planning.split_prefill``): a prompt the serving node would compute from
    scratch, while it and a colocated peer are both idle, is computed by the two at once (the peer the
    prefix, the node the rest, a layer apart): about half the time to the first token. Only between
    colocated nodes that run our connector (``tandem up --peer-kv``)."""
    split_prefill_min_tokens: int = Field(default=1024, ge=1)
    """The least a prompt must leave the serving node to compute for a split to be worth its second leg."""
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    """Upper bound on one upstream call (a whole non-streamed answer, or the gap between two chunks)."""
    upstream_dead_after_s: float = Field(default=15.0, ge=0.0)
    """How long a connection to an engine may go without a sign of life from the engine host's kernel
    (TCP keepalive probes while the router waits, the acknowledgement of what it sent) before it counts
    as broken (``router.upstream.sse_upstream.keep_alive``). A partition then ends the requests on it with an
    error within this, where ``request_timeout_s`` alone held a stream for 10 minutes (measured on
    ``tandem lab``, decode host cut mid-stream: no byte, no error for 180 s before the client gave up).
    A busy or stalled engine is never cut by it: its kernel answers the probes whatever the engine
    process does (its stalls are the node agent's to find). 0: no keepalive, only ``request_timeout_s``."""
    client_send_timeout_s: float = 60.0
    """Longest a streamed answer waits for its client to take more bytes (a client that stopped reading,
    with every buffer between full). Past it the stream is cut, its engine request aborted and its node
    slot given back, recorded as ``ClientStalled``; until then reading from the engine pauses."""
    keep_alive_s: int = Field(default=120, ge=1)
    """How long the router keeps a client's idle HTTP connection open. Longer than clients keep them
    in their pools (httpx and the openai SDK: 5 s; aiohttp 15 s; Go 90 s), so the client side always
    closes first: a server that closes a connection just as its client reuses it for a POST fails that
    request ("Server disconnected without sending a response"), which uvicorn's own 5 s invites."""
    retry_after_s: float = 2.0
    """Retry-After sent with 503 when no node can take a request."""
    cpu_priority: CpuPriority = CpuPriority.BATCH
    """Scheduling of the router's threads (``telemetry.priority``): ``batch`` (default) never preempts a
    running task when it wakes, so relaying a token never stalls an engine's forward pass mid-step on a
    shared CPU host (it waits for the end of the running slice, a few ms at most, where no core idles);
    ``normal`` leaves it as started; ``idle`` runs it only on otherwise idle cores (not for serving)."""
    huge_pages: bool = True
    """Run the router's Python heap on transparent huge pages (``router.huge_pages``): a router started
    without them restarts itself once with ``PYTHONMALLOC=malloc`` and glibc's ``hugetlb`` tunable.
    On a VM where a wake-up is dear it took a fifth off the router's CPU per request under ``tandem bench
    overhead``'s load (5.2 ms against 6.5); nothing happens where the kernel has no transparent huge
    pages, or the operator chose an allocator."""
    telemetry: bool = True
    """Emit a per-request record to the slow path (Redis Stream -> Parquet lake)."""
    telemetry_redis_url: str | None = None
    """Redis for telemetry streams; None uses redis_url."""
    telemetry_flush_s: float = Field(default=2.0, gt=0)
    """Longest a record waits in this router before it is sent to its stream (sooner once a batch is
    full). Each send has a fixed cost here (a journal segment, an Arrow batch per table, one round
    trip) and in the lake writer (a Parquet part): at 0.5 s a router serving a CPU engine spent 0.37 ms
    of CPU per request on it, at 2 s 0.16 (``tandem bench overhead``'s load, Xeon host)."""
    telemetry_journal_dir: Path | None = None
    """Journal of this router's telemetry (``telemetry.journal``): records of a router killed before it
    flushed are sent by the next one started with the same directory. One directory per replica
    (``tandem up`` gives each its own); None: no journal, the records of the last ``telemetry_flush_s``
    die with the process."""
    otlp_traces_endpoint: str | None = None
    """OTLP/HTTP endpoint (``http://host:4318/v1/traces``) that receives each finished request's spans
    (``telemetry.tracing``: route, prefill, transfer, decode, stream), exported in batches by a thread
    of their own. None (the default): no span is built."""
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    """Keys, rate limits, sessions and node slots (``TANDEM_*``, see ``AdmissionSettings``)."""
    default_max_tokens: int | None = None
    """max_tokens applied when a request gives none (None: up to the context window, as vLLM does)."""
    tokenize: Literal["auto", "always"] = "auto"
    """When the router renders and tokenizes a prompt itself (about 1 ms of CPU for 512 tokens):
    ``auto`` only when a decision needs the token ids, i.e. more than one node could serve the request
    (cache-aware placement, local-or-remote prefill) or a token-rate limit applies to its tenant; a
    one-node fleet without token limits then costs what plain vLLM costs, and the engine refuses an
    over-long prompt itself (the same 400). ``always``: every request, so the router refuses over-long
    prompts before any node works and every record carries the fleet index's hit prediction."""

    # -- the edge (router.edge.limits): what a client may send ----------------------------------------------
    max_body_bytes: int = 10 * 1024 * 1024
    """Largest request body (bytes) on any route: a larger Content-Length is refused with 413 before the
    body is read, a chunked body at the byte that passes it. 10 MiB holds a full 128k-token context
    with room to spare, and bounds the router's tokenizing to seconds of CPU."""
    max_header_bytes: int = 64 * 1024
    """Most bytes of request headers in all (names and values; 431 beyond it). Clients send a few
    hundred; a multi-megabyte header would be held, parsed and maybe stored like any other."""
    body_read_timeout_s: float = 30.0
    """Longest a request's body may take to arrive, from the request's start (408 past it, and the
    stream slot it holds goes back). 10 MiB takes well under a second on any real link. 0: unbounded."""
    max_json_depth: int = 64
    """Deepest nesting of objects and arrays in a body (400 beyond it). OpenAI's schemas need under ten
    levels; tool schemas a few more."""
    max_json_containers: int = 200_000
    """Most ``[`` and ``{`` in a body, counted before it is parsed (400 beyond it): parsing and checking
    millions of tiny arrays (10 MiB of ``[],``) would hold the event loop, and every stream on it, for
    seconds. Brackets inside strings count too, so the limit leaves room for a megabyte of dense code
    in a prompt."""
    max_messages: int = 4096
    """Most messages in one chat request (400 beyond it)."""
    max_message_chars: int = 2 * 1024 * 1024
    """Most characters in one message's content (its text parts summed; 400 beyond it)."""
    trust_request_chat_template: bool = False
    """Accept a client's ``chat_template`` (as vLLM's ``--trust-request-chat-template``; the engine
    must be started with it too). Off: such a request is a 400 before the router renders anything."""
    template_render_timeout_s: float = 2.0
    """Longest the router may spend rendering one prompt with a chat template (``router.template_deadline``);
    past it the request is a 400 ``invalid_prompt``, so no template (the model's, or a trusted client's)
    holds a router thread for longer. Real templates take about a millisecond. 0: unbounded."""
    chat_template_kwargs: frozenset[str] = frozenset(
        {"add_generation_prompt", "continue_final_message", "enable_thinking", "thinking", "reasoning_effort"}
    )
    """Names a client may give in ``chat_template_kwargs`` (scalar values only); any other is a 400.
    In the environment, a JSON list."""
    shared_cache_tenants: frozenset[str] = frozenset()
    """Tenants whose requests share one prefix cache (``router.planning.cache_salt``): once auth is on, every other
    tenant's requests carry a ``cache_salt`` of their own, so no tenant's prompts reuse (or reveal)
    another's cached blocks. ``["*"]``: every tenant shares, as with auth off. In the environment
    (``TANDEM_ROUTER_SHARED_CACHE_TENANTS``), a JSON list."""
    session_retention_s: float = Field(default=300.0, ge=0.0)
    """How long the host tier keeps a session's context pinned after its turn (``router.planning.retention``): a
    request naming a session (``x-session-id``, or OpenAI's ``prompt_cache_key``) asks the prefilling
    node's tier to keep its blocks through the tool pause before the next turn. A ``cache_control``
    ``ttl`` in the messages (Anthropic's ``5m`` / ``1h``) overrides it per request. 0: off."""
    session_retention_max_s: float = Field(default=3600.0, ge=0.0)
    """Longest TTL a request may ask for."""
    route_header: Literal["auto", "always", "never"] = "auto"
    """Who may force the path with ``x-tandem-route`` or pin a request to a node with ``x-tandem-node``:
    auto (default) while auth is off or for admin keys; always; never. A request that may not gets 403."""
    ws_idle_timeout_s: float = Field(default=600.0, gt=0.0)
    """How long a WebSocket (``GET /v1/responses`` or ``/v1/chat/completions`` upgraded,
    ``router.edge.codecs.websocket``) may stay open with no response in flight and no message from its
    client; past it the router closes it (1000). A socket's turns ask the host tier to keep their
    context this long (at most ``session_retention_max_s``), so a tool pause the socket allows never
    outlives its pins."""
    ws_max_age_s: float = Field(default=3600.0, gt=0.0)
    """Longest one socket lives: past it, once no response is in flight, an ``error`` event
    (``websocket_connection_limit_reached``, as OpenAI's) and a close with 1000; clients reconnect."""
    ws_max_per_tenant: int = Field(default=64, ge=1)
    """Most sockets one tenant holds open on one router replica; the next upgrade is refused with 429."""
