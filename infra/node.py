"""The node process (``tandem node``): runs one vLLM engine for a role and keeps it in the registry.

    tandem node ──spawn──▶ vllm serve (its own process group; OpenAI API on --port)
        │  wait for /health, read capacity from /metrics and /v1/models
        ├─ register NodeInfo in Redis, then every heartbeat_s: NodeLoad from /metrics
        └─ SIGTERM/SIGINT or engine exit: deregister, stop the engine, exit

The router talks to the engine's HTTP server directly; this process is only its agent, so a slow
heartbeat can never delay a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
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
from infra.engine_metrics import read_snapshot
from infra.errors import ConfigError, StoreError, UpstreamError
from infra.model import resolve_model
from infra.node_settings import NodeSettings
from infra.registry import NodeInfo, NodeLoad, NodeRegistry, Role
from kv_transfer import ENGINE_HOOKS, ConnectorKind, kv_transfer_config

log = logging.getLogger("tandem.node")


def engine_command(settings: NodeSettings, model_path: Path) -> list[str]:
    """The ``vllm serve`` command line for this node."""
    name = settings.served_model_name or model_path.name
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_path),
        "--host", settings.host, "--port", str(settings.port),
        "--served-model-name", name,
        "--dtype", settings.dtype,
        "--max-model-len", str(settings.max_model_len),
        "--enable-prefix-caching",
        # Routing keys are these block hashes, recomputed by the router (router/kv_index/block_keys.py):
        # sha256 of canonical CBOR does not depend on the node's Python/pickle, so router and node agree.
        "--prefix-caching-hash-algo", "sha256_cbor",
        # usage.prompt_tokens_details.cached_tokens: the engine-confirmed part of the hit-rate breakdown.
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        "--kv-events-config", json.dumps({
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": settings.kv_events_bind,
            "replay_endpoint": settings.kv_replay_endpoint,
            "topic": "kv-events",
        }),
    ]
    if settings.enforce_eager:
        cmd.append("--enforce-eager")
    if settings.block_size:
        cmd += ["--block-size", str(settings.block_size)]
    if settings.tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", settings.tool_call_parser]
    if settings.role is not Role.BOTH:
        kv_config = kv_transfer_config(settings.connector, extra=settings.kv_connector_extra,
                                       load_failure_policy=settings.kv_load_failure_policy)
        if kv_config:
            cmd += ["--kv-transfer-config", kv_config]
    if settings.role is Role.PREFILL:
        cmd += prefill_nodes.engine_args(settings)
    elif settings.role is Role.DECODE:
        cmd += decode_nodes.engine_args(settings)
    return cmd + list(settings.extra_engine_args)


def engine_env(settings: NodeSettings) -> dict[str, str]:
    if settings.kv_events_endpoint.startswith("ipc://"):
        Path(settings.kv_events_endpoint[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = settings.host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(settings.nixl_port)
    if settings.cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = settings.cores
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets UCX_* variables UCX itself may not use
    if settings.connector is ConnectorKind.NIXL and settings.role is not Role.BOTH:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENGINE_HOOKS), env.get("PYTHONPATH")) if p)
        env["TANDEM_NIXL_PROGRESS_THREAD"] = settings.nixl_progress_thread
    return env


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the node agent dies, even by SIGKILL, so an engine
    (and the KV blocks it holds) never outlives the agent that registered it."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EngineProcess:
    """One ``vllm serve`` child in its own process group, so stopping it stops its workers too."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        model_path = resolve_model(self.settings.model)
        out = None
        if self.settings.log_dir:
            self.settings.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.settings.log_dir / f"engine-{self.settings.node_id}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            engine_command(self.settings, model_path), env=engine_env(self.settings),
            stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
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


async def wait_until_healthy(engine: EngineProcess, client: httpx.AsyncClient, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = engine.exited()
        if code is not None:
            raise ConfigError(f"engine exited with status {code} during start-up (see its log)")
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get(f"{engine.settings.url}/health", timeout=2.0)).status_code == 200:
                return
        await asyncio.sleep(0.5)  # polling a child that has no readiness callback
    raise ConfigError(f"engine not healthy after {timeout_s:.0f} s")


async def describe(settings: NodeSettings, client: httpx.AsyncClient, model_path: Path) -> NodeInfo:
    models = (await client.get(f"{settings.url}/v1/models", timeout=5.0)).json()["data"]
    snap = await read_snapshot(client, settings.url)
    return NodeInfo(
        node_id=settings.node_id, role=settings.role, model=models[0]["id"], url=settings.url,
        block_size=snap.block_size or (settings.block_size or 0),
        max_model_len=int(models[0].get("max_model_len") or settings.max_model_len),
        kv_connector=settings.connector.value if settings.role is not Role.BOTH else "none",
        kv_events_endpoint=settings.kv_events_endpoint, kv_replay_endpoint=settings.kv_replay_endpoint,
        model_path=str(model_path), num_kv_blocks=snap.num_kv_blocks, started_at=time.time(),
    )


async def run_node(settings: NodeSettings, *, ready: asyncio.Event | None = None) -> int:
    """Run the node until a signal or the engine's exit. Returns the process exit status."""
    engine = EngineProcess(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    redis = aioredis.from_url(settings.redis_url)
    registry = NodeRegistry(redis, ttl_s=settings.registry_ttl_s)
    status = 0
    engine.start()
    try:
        async with httpx.AsyncClient() as client:
            waiter = asyncio.create_task(wait_until_healthy(engine, client, settings.startup_timeout_s))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if stop.is_set():
                waiter.cancel()
                return 0
            waiter.result()
            if settings.cores is not None and engine.proc is not None:
                n = pin_process_tree(engine.proc.pid, parse_cores(settings.cores))
                log.info("narrowed %d engine threads to cores %s", n, settings.cores)
            info = await describe(settings, client, resolve_model(settings.model))
            await registry.register(info)
            log.info("node %s (%s) ready at %s", info.node_id, info.role, info.url)
            print(f"READY node {info.node_id} role={info.role} url={info.url}", flush=True)
            if ready:
                ready.set()
            while not stop.is_set():
                code = engine.exited()
                if code is not None:
                    log.error("engine exited with status %s", code)
                    status = code or 1
                    break
                try:
                    snap = await read_snapshot(client, settings.url)
                    load = NodeLoad(running=snap.running, waiting=snap.waiting, kv_usage=snap.kv_usage,
                                    updated_at=time.time())
                    await registry.heartbeat(info, load)
                except (UpstreamError, StoreError) as exc:
                    # A missed beat is not fatal: the TTL covers a few; a dead engine is caught above.
                    log.warning("heartbeat skipped: %s", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), settings.heartbeat_s)
            with contextlib.suppress(StoreError):
                await registry.deregister(info.node_id)
    finally:
        await asyncio.to_thread(engine.stop)
        await redis.aclose()
    return status
