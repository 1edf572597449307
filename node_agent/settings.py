"""Settings of one node process (``tandem node``): one typed object, built once, passed down."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contracts.cluster import CLUSTER_ENV, DEFAULT_CLUSTER, NAME_PATTERN, runtime_dir
from contracts.config import DEFAULT_REDIS_URL, REDIS_URL_ENV
from contracts.registry import Role
from contracts.secret import engine_auth_headers
from kv_transfer import ConnectorKind, TransportName

WILDCARDS = frozenset({"0.0.0.0", "::", "*"})
"""Bind addresses that mean every interface: never an address to register."""


CPU_SPIN_MS = 1000.0
"""The step queues' spin on a CPU engine: vLLM's own (``NodeSettings.engine_spin_ms``)."""


class NodeSettings(BaseSettings):
    """Every field can also come from the environment as ``TANDEM_NODE_<FIELD>``, but the Redis URL,
    which is every process's ``TANDEM_REDIS_URL`` (``contracts.config``)."""

    model_config = SettingsConfigDict(
        env_prefix="TANDEM_NODE_", frozen=True, validate_by_name=True, validate_by_alias=True
    )

    role: Role = Role.BOTH
    """prefill: computes prompts and hands their KV to a decode node. decode: loads KV and generates.
    both: colocated, serves whole requests itself."""
    model: str | None = None
    """Hugging Face model folder; None means the prepared default model."""
    served_model_name: str | None = None
    """Name clients use in ``model``; defaults to the folder name."""
    host: str = "127.0.0.1"
    """Address the engine and the node's KV sockets bind (``0.0.0.0``: every interface)."""
    advertise_host: str | None = None
    """Address other hosts reach this node at, as registered for routers and decode nodes (engine URL,
    KV events, event replay, block server, NIXL side channel); None: ``host``. Needed when ``host`` is a
    wildcard, or an address peers cannot use (a container's own, behind a mapped one)."""
    port: int = 8100
    """HTTP port of the engine. Side ports: port+1 KV events (PUB), port+2 event replay, port+3 KV block
    server (tandem connector) or NIXL side channel."""
    node_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
    redis_url: str = Field(default=DEFAULT_REDIS_URL, validation_alias=REDIS_URL_ENV)
    cluster: str = Field(default=DEFAULT_CLUSTER, validation_alias=CLUSTER_ENV, pattern=NAME_PATTERN)
    """Name of the cluster this process belongs to (``TANDEM_CLUSTER``, set by ``tandem up --cluster``):
    every Redis key and host path it uses is under it (``contracts.cluster``)."""
    connector: ConnectorKind = ConnectorKind.TANDEM
    kv_transport: TransportName = TransportName.AUTO
    """Tandem connector: how this node pulls KV. auto = shm (cross-memory copy) when the prefill node is
    on this host, else tcp; ucx goes through ucxx-cu12."""
    kv_checksum: Literal["auto", "always", "never"] = "auto"
    """Tandem connector: verify an xxh3 checksum per segment (auto: on for tcp/ipc frames, off for shm)."""
    kv_lease_s: float = 30.0
    """Tandem connector: how long a prefill node holds a request's blocks for its decode node, at most."""
    kv_transfer_timeout_s: float = 10.0
    """Tandem connector: how long a decode node waits for one pull before prefilling itself."""
    kv_faults: bool = Field(default=False, validation_alias=AliasChoices("TANDEM_NODE_KV_FAULTS", "TANDEM_KV_FAULTS"))
    """Tandem connector, for tests: let peers arm faults (corrupt, stall, hold, expire) on this node's
    block server (``ConnectorSettings.faults``); its engine logs a WARNING when on."""
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    """When a pull fails: recompute the prompt on the decode node, or fail the request."""
    host_tier_endpoint: str | None = None
    """The host tier's control socket (``tandem tier serve``): the engine offloads finished prompts' blocks
    there and loads them on a miss (``host_tier.connector``); the agent names the tier's event
    endpoints in its registry entry, so routers know what the tier holds. None: no host tier."""
    peer_kv: bool = False
    """A colocated node (role both) runs our connector too, so that peers can load the prefixes its engine
    holds and it theirs, instead of computing them (the router's ``peer_fetch``, ``router.planning.peer_fetch``).
    Prefill and decode nodes run it anyway. Off by default: a colocated node then runs a plain engine."""
    host_tier_timeout_s: float = 0.5
    """How long the engine waits for the tier to answer one lookup (on the scheduler's thread) before it
    leaves the tier off for a while and computes instead: a tier that hangs costs a miss, not a stall."""
    dtype: str = "auto"
    """Weights/activations dtype. ``auto``: bfloat16 where the CPU computes it natively (or on GPU
    builds, vLLM's own choice), else float32 (``node_agent.dtype``). Tests use float32, where greedy
    outputs are bit-stable."""
    max_model_len: int = 8192
    block_size: int | None = None
    """KV block size in tokens; None keeps the engine's default (128 on CPU)."""
    kv_cache_gib: int = 1
    """KV cache size (VLLM_CPU_KVCACHE_SPACE on CPU)."""
    cores: str | None = None
    """CPU cores to pin the engine's threads to, e.g. "0" or "0-1" (VLLM_CPU_OMP_THREADS_BIND)."""
    enforce_eager: bool = True
    """Skip torch.compile: ~35 s start instead of 67-160 s on CPU (the compile cache is not reused)."""
    nixl_progress_thread: Literal["idle", "normal"] = "idle"
    """NIXL's UCX progress thread busy-polls a core: ``idle`` runs it at SCHED_IDLE priority, ``normal``
    leaves NIXL as shipped. See kv_transfer/engine_hooks/sitecustomize.py."""
    engine_spin_ms: float | None = Field(default=None, ge=0)
    """How long vLLM's step queues busy-wait (``sched_yield``) for the next message before they sleep
    until notified. vLLM spins for 1 s after every message. None: vLLM's 1 s on every build; on CPU builds
    it is set explicitly (``CPU_SPIN_MS``) so the hook's wake-up fixes apply. A spinner yields the core
    at once to a worker thread that has work, while a sleeper woken by a notification waits for the
    scheduler behind that busy core. Measured on a 2-core host: agent sessions over two colocated
    one-core nodes took 40 s with 1000 and 55 s with 0. One engine on both cores, one stream, took
    24.5 ms per token with 1000 and 123 ms with 0; eight streams took 32 and 30 ms. So 0, once the
    default for engines of two cores or more, is now only an override. See
    kv_transfer/engine_hooks/sitecustomize.py."""
    engine_keep_alive_s: int = Field(default=90, ge=1)
    """How long the engine's HTTP server keeps an idle connection (VLLM_HTTP_TIMEOUT_KEEP_ALIVE; vLLM's
    own is 5 s). Longer than the router keeps idle connections to engines (60 s, router/upstream/node_client.py),
    so the router always closes first and never sends a request down a connection the engine is just
    closing ("Server disconnected without sending a response")."""
    heartbeat_s: float = 2.0
    """How often the agent writes the engine's load to the registry and probes the engine's health."""
    redis_timeout_s: float = Field(default=2.0, gt=0.0)
    """Longest a registry call may wait for Redis (connect, and each reply). A Redis that accepts and
    never answers then costs a heartbeat, not the agent: it keeps probing, restarting and stopping its
    engine, and beats again once Redis answers."""
    registry_ttl_s: float = 15.0
    """Lifetime of the node's registry entry, refreshed every heartbeat. It must outlast the longest
    heartbeat round (``heartbeat_s`` plus the two probe timeouts), or one slow probe of a busy but live
    engine drops the node from routing and its blocks from the fleet index. Only an agent that died
    without deregistering (SIGKILL) waits this long to leave routing: a dead or hung engine is
    deregistered at once, a node a router cannot reach is marked down at once."""
    startup_timeout_s: float = 600.0
    """Longest an engine may take to answer /health after its start; longer counts as a failed start."""
    restart_backoff_s: float = 1.0
    """Delay before restarting an engine after the first failure in the window; doubles with each
    further failure in the window (node_agent/supervisor.py)."""
    restart_backoff_max_s: float = 30.0
    """Cap of that delay."""
    max_failures: int = 5
    """Engine failures (exit, hang, failed start) within ``failure_window_s`` after which the agent
    stops restarting, marks the node unhealthy and exits non-zero, instead of looping."""
    failure_window_s: float = 600.0
    """Sliding window in which ``max_failures`` is counted; older failures are forgotten."""
    drain_timeout_s: float = 0.0
    """On SIGTERM/SIGINT, after deregistering (routers stop sending within their next registry read):
    how long to wait, at most, for the engine to finish its requests and for its KV leases to end (the
    decode nodes pulling what it prefilled) before stopping it. 0: stop it at once. Kubernetes pods
    set it below their grace period (infra/helm)."""
    health_timeout_s: float = 5.0
    """Timeout of one probe of the engine (GET /health and /metrics)."""
    health_failures: int = 3
    """Consecutive failed probes (one every ``heartbeat_s``) after which the engine counts as hung and
    is killed and restarted."""
    stall_timeout_s: float = 30.0
    """An engine with requests running or waiting whose token counters do not move for this long while
    it computes nothing (its processes use under ``COMPUTING_CORES`` of CPU), or with a process stopped
    (SIGSTOP, state T) for this long, counts as hung."""
    stall_compute_timeout_s: float = 300.0
    """An engine that keeps computing (0.2 of a core or more), or waits for a KV pull its connector
    has under way (``tandem_kv_pulls_active``), without its token counters moving counts as hung after
    this long. On a slow CPU one prefill step of a long prompt takes longer than
    ``stall_timeout_s`` (measured on a 2-core AVX2 host: 2,400 prompt tokens in 65 s), and restarting
    it then only repeats the work."""
    tool_call_parser: str | None = "pythonic"
    """vLLM tool-call parser for ``tools`` / ``tool_choice`` (auto tool choice on). ``pythonic`` needs no
    special tokens, which the default model lacks (hermes needs <tool_call>); None turns tools off."""
    extra_engine_args: list[str] = Field(default_factory=list)
    engine_command: list[str] | None = None
    """Replaces the whole ``vllm serve`` command line (a wrapper script, another build); ``{port}`` in
    an argument becomes ``port``. The supervision tests run a stand-in engine through it
    (``TANDEM_NODE_ENGINE_COMMAND='["python", "-m", "tests.support.fake_engine", "--port", "{port}"]'``)."""
    engine_auth: bool = True
    """Start the engine with an API key (``VLLM_API_KEY``, derived from the cluster secret:
    ``contracts.secret.engine_api_key``) that only node agents and routers hold, so that whoever else
    reaches the engine's port gets 401 on ``/v1/*``. Passed in the environment, never on the command
    line (``ps`` shows it). False: an open engine (a benchmark's plain-vLLM arm)."""
    log_dir: Path | None = None
    """Where the engine's stdout/stderr go; None inherits the node's."""
    otlp_traces_endpoint: str | None = None
    """OTLP endpoint that receives the engine's own spans (vLLM ``--otlp-traces-endpoint``): the collector
    the routers' ``TANDEM_ROUTER_OTLP_TRACES_ENDPOINT`` names, e.g. ``http://host:4318/v1/traces``.
    vLLM parents each request's ``llm_request`` span on the ``traceparent`` the router sends
    (``telemetry.tracing``), so they join the router's trace. The engine exports over HTTP/protobuf
    unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says otherwise (vLLM's own default is gRPC), as
    service ``vllm-<node_id>``. None (the default): no tracing."""

    @model_validator(mode="after")
    def _ttl_outlasts_a_heartbeat_round(self) -> NodeSettings:
        round_s = self.heartbeat_s + 2 * self.health_timeout_s
        if self.registry_ttl_s <= round_s:
            raise ValueError(
                f"registry_ttl_s ({self.registry_ttl_s:g} s) must exceed heartbeat_s + 2 * health_timeout_s "
                f"({round_s:g} s): a node whose probe is slow would otherwise drop out of routing while alive"
            )
        return self

    def step_queue_spin(self) -> float | None:
        """``engine_spin_ms`` resolved for this build (None: leave vLLM's)."""
        if self.engine_spin_ms is not None:
            return self.engine_spin_ms
        from node_agent.dtype import is_cpu_build

        return CPU_SPIN_MS if is_cpu_build() else None

    def engine_headers(self) -> dict[str, str]:
        """Headers of this node's own calls to its engine (the API key, when ``engine_auth``). Raises
        ``ConfigError`` for a node on a non-loopback address without an explicit cluster secret."""
        return engine_auth_headers(loopback_only=self.is_loopback) if self.engine_auth else {}

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def url(self) -> str:
        """Where this node's agent reaches its own engine (a wildcard bind is reached on loopback)."""
        host = "127.0.0.1" if self.host in WILDCARDS else self.host
        return f"http://{host}:{self.port}"

    @property
    def advertised_url(self) -> str:
        """The engine's URL as registered: where routers send requests."""
        return f"http://{self.advertised_host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")

    @property
    def _ipc_dir(self) -> Path:
        return runtime_dir(self.cluster)

    @property
    def kv_events_relayed(self) -> bool:
        """A node on a real interface never lets its engine publish KV events (token ids: tenants'
        prompts) or replay them there: the engine uses ipc sockets and the agent's CURVE relay
        (``node_agent.kv_events_relay``) serves the TCP endpoints to holders of the cluster secret."""
        return not self.is_loopback

    @property
    def kv_events_endpoint(self) -> str:
        """Where subscribers connect (registered). vLLM's publisher binds only wildcard and ipc
        endpoints (it *connects* to anything else): a loopback node's engine publishes on an ipc
        socket; a node on a real interface registers its relay's tcp://<advertised>:port+1."""
        if self.is_loopback:
            return self.kv_events_bind
        return f"tcp://{self.advertised_host}:{self.port + 1}"

    @property
    def kv_events_bind(self) -> str:
        """The endpoint given to vLLM's publisher (bind form): always an ipc socket of this host."""
        return f"ipc://{self._ipc_dir}/kv-events-{self.port}.sock"

    @property
    def kv_replay_endpoint(self) -> str:
        """Where subscribers ask for missed KV events (registered)."""
        return f"tcp://{self.advertised_host}:{self.port + 2}"

    @property
    def kv_replay_bind(self) -> str:
        """The replay endpoint given to vLLM, which binds it: 127.0.0.1 on a loopback node, else an ipc
        socket behind the relay."""
        if self.is_loopback:
            return f"tcp://{self.host}:{self.port + 2}"
        return f"ipc://{self._ipc_dir}/kv-replay-{self.port}.sock"

    @property
    def relay_binds(self) -> tuple[str, str]:
        """What the relay binds for KV events and their replay (on a node that relays)."""
        host = "*" if self.host in WILDCARDS else self.host
        return f"tcp://{host}:{self.port + 1}", f"tcp://{host}:{self.port + 2}"

    @property
    def nixl_port(self) -> int:
        return self.port + 3

    @property
    def engine_ports(self) -> dict[int, str]:
        """TCP ports the engine binds (port -> what for), checked free before every start. A loopback
        node publishes KV events on an ipc socket, and so does every engine of a node on a real
        interface, whose agent's relay binds port+1 and port+2 itself (checked by that bind, once, at
        the agent's start); a colocated node runs no connector unless it has ``peer_kv``."""
        ports = {self.port: "engine HTTP"}
        if self.is_loopback:
            ports[self.port + 2] = "KV event replay"
        if self.runs_connector:
            ports[self.nixl_port] = "NIXL side channel" if self.connector is ConnectorKind.NIXL else "KV block server"
        return ports

    @property
    def runs_connector(self) -> bool:
        """Whether the engine runs a P/D connector: prefill and decode nodes, and a colocated node with
        ``peer_kv`` (ours only: NIXL serves no prefixes to peers)."""
        if self.connector is ConnectorKind.NONE:
            return False
        return self.role is not Role.BOTH or (self.peer_kv and self.connector is ConnectorKind.TANDEM)

    @property
    def kv_connector_extra(self) -> dict[str, object]:
        """The tandem connector's ``kv_connector_extra_config`` (kv_transfer.settings.ConnectorSettings)."""
        extra: dict[str, object] = {
            "host": self.advertised_host,
            "port": self.nixl_port,
            "transport": self.kv_transport.value,
            "checksum": self.kv_checksum,
            "lease_s": self.kv_lease_s,
            "transfer_timeout_s": self.kv_transfer_timeout_s,
        }
        if self.kv_faults:
            extra["faults"] = True
        if self.advertise_host and self.host not in WILDCARDS:
            extra["bind_host"] = self.host  # else: the connector binds every interface for a non-loopback host
        return extra
