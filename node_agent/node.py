"""The node process (``tandem node``): runs one vLLM engine for a role and keeps it in the registry.

    tandem node ──spawn──▶ vllm serve (its own process group; OpenAI API on --port)
        │  check the engine's ports are free, wait for /health, read capacity from /metrics, /v1/models
        ├─ register NodeInfo (with a new epoch) in Redis, then every heartbeat_s: NodeLoad from /metrics
        ├─ engine exit or hang: deregister at once, restart with backoff (node_agent/supervisor.py)
        └─ SIGTERM/SIGINT: deregister, stop the engine, exit 0; too many failures: exit 3 (unhealthy)

The router talks to the engine's HTTP server directly; this process is only its agent, so a slow
heartbeat can never delay a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis.asyncio as aioredis

import decode_nodes
import prefill_nodes
from contracts.errors import ConfigError
from contracts.registry import NodeInfo, NodeRegistry, Role, registry_proof_key
from contracts.secret import cluster_engine_api_key, curve_keys, load_cluster_secret
from host_tier.client import tier_endpoints
from host_tier.connector_config import with_host_tier
from kv_transfer import ENGINE_HOOKS, ConnectorKind, kv_transfer_config
from kv_transfer.settings import ConnectorSettings, host_id
from node_agent.dtype import resolve_dtype
from node_agent.engine_guard import EngineGuard
from node_agent.engine_metrics import read_snapshot
from node_agent.kv_events_relay import KVEventsRelay
from node_agent.lifetime import die_with_parent, stop_group
from node_agent.model import resolve_model
from node_agent.ports import check_ports_free
from node_agent.settings import NodeSettings
from node_agent.supervisor import Engine, EngineSupervisor

log = logging.getLogger("tandem.node")


def engine_command(settings: NodeSettings, model_path: Path) -> list[str]:
    """The ``vllm serve`` command line for this node."""
    name = settings.served_model_name or model_path.name
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_path),
        "--host",
        settings.host,
        "--port",
        str(settings.port),
        "--served-model-name",
        name,
        "--dtype",
        resolve_dtype(settings.dtype),
        "--max-model-len",
        str(settings.max_model_len),
        "--enable-prefix-caching",
        # Routing keys are these block hashes, recomputed by the router (router/kv_index/block_keys.py):
        # sha256 of canonical CBOR does not depend on the node's Python/pickle, so router and node agree.
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        # usage.prompt_tokens_details.cached_tokens: the engine-confirmed part of the hit-rate breakdown.
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        "--kv-events-config",
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": settings.kv_events_bind,
                "replay_endpoint": settings.kv_replay_bind,
                "topic": "kv-events",
            }
        ),
    ]
    if settings.enforce_eager:
        cmd.append("--enforce-eager")
    if settings.block_size:
        cmd += ["--block-size", str(settings.block_size)]
    if settings.tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", settings.tool_call_parser]
    if settings.otlp_traces_endpoint:
        cmd += ["--otlp-traces-endpoint", settings.otlp_traces_endpoint]
    kv_config = None
    if settings.runs_connector:
        kv_config = kv_transfer_config(
            settings.connector, extra=settings.kv_connector_extra, load_failure_policy=settings.kv_load_failure_policy
        )
    if settings.host_tier_endpoint:
        kv_config = with_host_tier(
            kv_config, settings.host_tier_endpoint, settings.kv_load_failure_policy, settings.host_tier_timeout_s
        )
    if kv_config:
        cmd += ["--kv-transfer-config", kv_config]
    if settings.engine_auth:  # vLLM's own key check leaves /invocations, /tokenize and more open
        cmd += ["--middleware", f"{EngineGuard.__module__}.{EngineGuard.__qualname__}"]
    if settings.role is Role.PREFILL:
        cmd += prefill_nodes.engine_args(settings.max_model_len)
    elif settings.role is Role.DECODE:
        cmd += decode_nodes.engine_args(settings.max_model_len)
    return cmd + list(settings.extra_engine_args)


def engine_env(settings: NodeSettings) -> dict[str, str]:
    Path(settings.kv_events_bind[len("ipc://") :]).parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)
    # NIXL binds its side channel there and hands the same address to peers: the advertised one.
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = settings.advertised_host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(settings.nixl_port)
    if settings.cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = settings.cores
    env.pop("VLLM_API_KEY", None)
    if settings.engine_auth:  # in the environment: a command line is visible to every user in ps
        env["VLLM_API_KEY"] = cluster_engine_api_key(loopback_only=settings.is_loopback)
    env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(settings.engine_keep_alive_s)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets UCX_* variables UCX itself may not use
    if settings.otlp_traces_endpoint:
        # vLLM's exporter reads the protocol here and defaults to gRPC (vllm/tracing/otel.py,
        # get_span_exporter); the router and an OTLP/HTTP collector speak HTTP/protobuf.
        env.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        env["OTEL_SERVICE_NAME"] = f"vllm-{settings.node_id}"  # vLLM's Resource.create reads it
    # Every engine process starts with our hooks (kv_transfer/engine_hooks/sitecustomize.py).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENGINE_HOOKS), env.get("PYTHONPATH")) if p)
    env["TANDEM_NIXL_PROGRESS_THREAD"] = settings.nixl_progress_thread
    spin_ms = settings.step_queue_spin()
    if spin_ms is None:
        env.pop("TANDEM_ENGINE_SPIN_MS", None)
    else:
        env["TANDEM_ENGINE_SPIN_MS"] = f"{spin_ms:g}"
    return env


class EngineProcess:
    """One engine child in its own process group, so stopping it stops its workers too. It gets SIGTERM
    when the node agent dies, even by SIGKILL (parent-death signal), so an engine and the KV blocks it
    holds never outlive the agent that registered it. ``command`` replaces the ``vllm serve`` line
    (tests run a small stand-in process under the same supervision)."""

    def __init__(
        self, settings: NodeSettings, command: list[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.settings = settings
        self.command = command
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        if self.command:
            command = self.command
        elif self.settings.engine_command:
            command = [arg.replace("{port}", str(self.settings.port)) for arg in self.settings.engine_command]
        else:
            command = engine_command(self.settings, resolve_model(self.settings.model))
        out = None
        if self.settings.log_dir:
            self.settings.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.settings.log_dir / f"engine-{self.settings.node_id}.log", "ab")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                command,
                env=self.env or engine_env(self.settings),
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        finally:
            if out is not None:
                out.close()  # the child holds its own copy

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the group, SIGKILL what is left after ``timeout_s``; returns once every member of the
        group is gone (the leader may die before vLLM's engine core, which holds ports and the cache)."""
        if self.proc is None:
            return
        stop_group(self.proc.pid, sig=signal.SIGTERM, timeout_s=timeout_s)
        self.proc.wait()

    def kill(self) -> None:
        """SIGKILL the group at once (a hung or stopped engine cannot act on SIGTERM) and wait for it."""
        if self.proc is None:
            return
        stop_group(self.proc.pid, sig=signal.SIGKILL)
        self.proc.wait()


def parse_cores(spec: str) -> set[int]:
    """ "0", "0-3" or "0,2-3" to a set of core ids."""
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def pin_process_tree(pid: int, cores: set[int]) -> int:
    """Keep every thread of ``pid`` and its descendants inside ``cores``; returns the threads narrowed.

    Only a thread that may run outside the node's cores is changed, and it gets the node's whole set.
    A thread already inside them keeps its affinity: vllm-cpu binds each OpenMP thread to one core of
    VLLM_CPU_OMP_THREADS_BIND (the worker's main thread is OpenMP thread 0), and widening those to the
    node's set let them migrate and collide; that alone cost a quarter of a 2-core node's throughput
    (issue 11: plain ``vllm serve`` 2.5-2.8 req/s, the same engine re-pinned 1.86-1.89). What this
    still narrows is what vLLM leaves unbound: the API server process, the engine core's helper
    threads, NIXL's busy-polling progress thread; on a host split between P and D they would otherwise
    run on the other node's cores. Threads started later inherit the affinity of their creator.
    """
    import psutil

    narrowed = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, FileNotFoundError):
            for thread in proc.threads():
                with contextlib.suppress(OSError):  # the thread may end while we look
                    if os.sched_getaffinity(thread.id) <= cores:
                        continue
                    os.sched_setaffinity(thread.id, cores)
                    narrowed += 1
    return narrowed


def block_server(settings: NodeSettings) -> tuple[dict[str, str], str]:
    """The engine's KV block server as the registry advertises it (endpoints, host id), from the very
    settings its connector is given; nothing for a node without our connector."""
    if not settings.runs_connector or settings.connector is not ConnectorKind.TANDEM:
        return {}, ""
    return ConnectorSettings.model_validate(settings.kv_connector_extra).endpoints, host_id()


async def describe(settings: NodeSettings, client: httpx.AsyncClient, model_path: Path, epoch: int = 0) -> NodeInfo:
    models = (await client.get(f"{settings.url}/v1/models", timeout=5.0)).json()["data"]
    snap = await read_snapshot(client, settings.url)
    kv_endpoints, kv_host_id = block_server(settings)
    tier_events = tier_replay = None
    if settings.host_tier_endpoint:
        # The engine started, so its connector found the tier moments ago; a tier that does not answer
        # now only costs the routers its hits' foresight, never a request.
        try:
            tier_events, tier_replay = await asyncio.to_thread(tier_endpoints, settings.host_tier_endpoint)
        except ConfigError as exc:
            log.warning("host tier events unknown: %s", exc.message)
    return NodeInfo(
        node_id=settings.node_id,
        role=settings.role,
        model=models[0]["id"],
        url=settings.advertised_url,
        block_size=snap.block_size or (settings.block_size or 0),
        max_model_len=int(models[0].get("max_model_len") or settings.max_model_len),
        kv_connector=settings.connector.value if settings.runs_connector else "none",
        kv_events_endpoint=settings.kv_events_endpoint,
        kv_replay_endpoint=settings.kv_replay_endpoint,
        kv_events_auth="curve" if settings.kv_events_relayed else "none",
        host_tier_events_endpoint=tier_events,
        host_tier_replay_endpoint=tier_replay,
        model_path=str(model_path),
        num_kv_blocks=snap.num_kv_blocks,
        started_at=time.time(),
        epoch=epoch,
        kv_endpoints=kv_endpoints,
        kv_host_id=kv_host_id,
    )


async def run_node(settings: NodeSettings, *, ready: asyncio.Event | None = None) -> int:
    """Run the node until a signal, or until its engine keeps failing. Returns the process exit status:
    0 after a signal, ``supervisor.EXIT_UNHEALTHY`` when it gave up; raises ``PortInUse`` (a
    ``ConfigError``) when a port is taken at start."""
    model_path = resolve_model(settings.model)  # a missing model fails the node at once, not per restart
    settings.engine_headers()  # so does a missing cluster secret (ConfigError)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    timeout = settings.redis_timeout_s
    redis = aioredis.from_url(settings.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout)
    proof_key = registry_proof_key(load_cluster_secret(loopback_only=settings.is_loopback), settings.cluster)
    registry = NodeRegistry(redis, ttl_s=settings.registry_ttl_s, cluster=settings.cluster, proof_key=proof_key)

    def on_healthy(engine: Engine) -> None:
        if settings.cores is not None and engine.pid is not None:
            n = pin_process_tree(engine.pid, parse_cores(settings.cores))
            log.info("narrowed %d engine threads to cores %s", n, settings.cores)

    def on_ready(info: NodeInfo) -> None:
        if ready:
            ready.set()

    async def describe_engine(client: httpx.AsyncClient, epoch: int) -> NodeInfo:
        return await describe(settings, client, model_path, epoch)

    supervisor = EngineSupervisor(
        settings, registry, lambda: EngineProcess(settings), describe_engine, on_healthy=on_healthy, on_ready=on_ready
    )
    relay = kv_events_relay(settings)  # before the engine: a port it cannot bind fails the node at once
    try:
        return await supervisor.run(stop)
    finally:
        if relay is not None:
            relay.close()
        await redis.aclose()


def kv_events_relay(settings: NodeSettings) -> KVEventsRelay | None:
    """The node's CURVE relay of its engine's KV events (a node on a real interface), started; for the
    node's whole life, engine restarts included (the engine's ipc sockets keep their paths)."""
    if not settings.kv_events_relayed:
        return None
    events_bind, replay_bind = settings.relay_binds
    check_ports_free(settings.host, {settings.port + 1: "KV events relay", settings.port + 2: "KV event replay relay"})
    relay = KVEventsRelay(
        engine_events=settings.kv_events_bind,
        engine_replay=settings.kv_replay_bind,
        events_bind=events_bind,
        replay_bind=replay_bind,
        keys=curve_keys(load_cluster_secret(loopback_only=False)),
    )
    relay.start()
    return relay


__all__ = ["EngineProcess", "describe", "engine_command", "engine_env", "parse_cores", "pin_process_tree", "run_node"]
