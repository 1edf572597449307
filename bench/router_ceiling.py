"""``tandem bench overhead``'s router ceiling: SSE chunks the router process relays per second alone on one
core, over the labelled STAND-IN engine (``bench.standin_engine``, token-streaming mode) on the others,
many streams at once; then its CPU per chunk at a CPU engine's pace (a paced stand-in), where every chunk
is a wake-up of its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import psutil

from bench.procs import cpu_s, router_command, sched_cpu_s, stop_all, wait_http
from bench.standin_engine import STANDIN_LABEL, free_port
from contracts.errors import ConfigError
from contracts.registry import Role

if TYPE_CHECKING:
    from bench.overhead import OverheadBenchConfig
    from contracts.registry import NodeInfo


def _log(msg: str) -> None:
    print(f"[overhead {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def _count_chunks(url: str, model: str, streams: int, tokens: int, include_usage: bool = False) -> int:
    """``streams`` streamed chats at once through ``url``: the chunks they carried (``[DONE]`` not
    counted); ``include_usage`` asks for the usage chunk too (what a client that reads usage costs)."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body: dict[str, object] = {
            "model": model,
            "stream": True,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"ceiling {uuid.uuid4().hex} {i}"}],
        }
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        n = 0
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise ConfigError(f"ceiling stream failed: {resp.status} {(await resp.read())[:200]!r}")
            async for block in resp.content.iter_any():
                n += block.count(b"data: ")
        return n - 1  # [DONE]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams + 4)) as session:
        counts = await asyncio.gather(*(one(session, i) for i in range(streams)))
    return sum(counts)


def _standin(port: int, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """A stand-in engine process on ``port`` (``bench.standin_engine`` options in ``args``), answering."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.standin_engine", "--port", str(port), *args],
        stdout=open(log, "ab"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", lambda: proc.poll() is None, 60)
    except BaseException:
        proc.kill()  # not yet among the caller's processes to stop
        proc.wait()
        raise
    return proc


def _standin_node(model: str, port: int) -> NodeInfo:
    """The registry entry of a stand-in engine on ``port`` serving ``model``: a colocated node whose
    tokenizer (the one the router warms) is the default model's, as for a real node."""
    from contracts.registry import NodeInfo
    from node_agent.model import default_model_dir

    return NodeInfo(
        node_id=f"standin-{model}",
        role=Role.BOTH,
        model=model,
        url=f"http://127.0.0.1:{port}",
        block_size=128,
        max_model_len=1 << 20,
        kv_connector="none",
        model_path=str(default_model_dir()),
    )


def router_ceiling(cfg: OverheadBenchConfig) -> dict[str, Any]:
    """SSE chunks relayed per second by the router process alone on one core (the first), over the
    stand-in engine and the load client on the others."""
    from contracts.registry import NodeRegistry

    cores = sorted(os.sched_getaffinity(0))
    router_core, other = {cores[0]}, set(cores[1:]) or {cores[0]}
    engine_port, router_port = free_port(), free_port()
    model = f"standin-ceiling-{uuid.uuid4().hex[:8]}"
    logs = cfg.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    node = _standin_node(model, engine_port)
    procs: list[subprocess.Popen[bytes]] = []
    me = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, other)  # the client, and the children started from here, stay off the router's core
        procs.append(_standin(engine_port, logs / "ceiling-standin.log", "--stream-tokens", str(cfg.ceiling_tokens)))
        paced_port = free_port()
        paced_node = msgspec.structs.replace(
            node, node_id=f"{node.node_id}-paced", model=f"{model}-paced", url=f"http://127.0.0.1:{paced_port}"
        )
        procs.append(
            _standin(
                paced_port,
                logs / "ceiling-standin-paced.log",
                *("--stream-tokens", "32", "--token-interval-ms", str(cfg.paced_interval_ms)),
            )
        )
        for n in (node, paced_node):
            asyncio.run(NodeRegistry(_async_redis(cfg.redis_url), ttl_s=3600).register(n))
        router = _start_router(cfg, router_port, router_core, logs)
        procs.append(router)
        url = f"http://127.0.0.1:{router_port}"
        asyncio.run(_count_chunks(url, model, 4, 50))  # warm-up: tokenizer loaded, pool open
        runs = [_ceiling_round(url, model, router.pid, cfg) for _ in range(cfg.ceiling_rounds)]
        best = max(runs, key=lambda x: x["chunks_per_s"])
        paced_run = _paced_round(url, paced_node.model, router.pid, cfg)
        return {
            "paced": paced_run,
            "engine": STANDIN_LABEL,
            "streams": cfg.ceiling_streams,
            "tokens_per_stream": cfg.ceiling_tokens,
            "router_core": sorted(router_core),
            "runs": runs,
            "chunks_per_s": best["chunks_per_s"],
            "chunks_per_router_cpu_s": best["chunks_per_router_cpu_s"],
        }
    finally:
        os.sched_setaffinity(0, me)
        stop_all(procs)
        for node_id in (node.node_id, f"{node.node_id}-paced"):
            asyncio.run(NodeRegistry(_async_redis(cfg.redis_url), ttl_s=3600).deregister(node_id))


def _start_router(cfg: OverheadBenchConfig, port: int, core: set[int], logs: Path) -> subprocess.Popen[bytes]:
    """A router process pinned to ``core`` (every thread), answering."""
    env = {**os.environ, "TANDEM_DATABASE_URL": f"sqlite:///{cfg.workdir}/ceiling-router.db"}
    router = subprocess.Popen(
        [*router_command(port, cfg.redis_url), "--log-level", "warning"],
        env=env,
        stdout=open(logs / "ceiling-router.log", "ab"),  # noqa: SIM115 - the child holds it
        stderr=subprocess.STDOUT,
    )
    os.sched_setaffinity(router.pid, core)
    wait_http(f"http://127.0.0.1:{port}/health", lambda: router.poll() is None, 120)
    for t in psutil.Process(router.pid).threads():  # threads started before the pin above
        with contextlib.suppress(OSError):
            os.sched_setaffinity(t.id, core)
    return router


def _ceiling_round(url: str, model: str, pid: int, cfg: OverheadBenchConfig) -> dict[str, Any]:
    """One round of ``ceiling_streams`` streams at once: chunks per second and per router CPU-second."""
    cpu0, t0 = cpu_s(pid), time.perf_counter()
    chunks = asyncio.run(_count_chunks(url, model, cfg.ceiling_streams, cfg.ceiling_tokens))
    wall, cpu = time.perf_counter() - t0, cpu_s(pid) - cpu0
    _log(
        f"ceiling: {chunks} chunks in {wall:.2f} s = {chunks / wall:,.0f}/s "
        f"(router CPU {cpu:.2f} s, {chunks / max(cpu, 1e-9):,.0f} chunks per CPU-second)"
    )
    return {
        "chunks": chunks,
        "wall_s": round(wall, 3),
        "router_cpu_s": round(cpu, 3),
        "chunks_per_s": round(chunks / wall),
        "chunks_per_router_cpu_s": round(chunks / max(cpu, 1e-9)),
    }


def _paced_round(url: str, model: str, pid: int, cfg: OverheadBenchConfig, streams: int = 16) -> dict[str, Any]:
    """``streams`` 32-token streams at a CPU engine's pace: every chunk its own wake-up."""
    cpu0 = sched_cpu_s(pid)
    chunks = asyncio.run(_count_chunks(url, model, streams, 32))
    cpu = sched_cpu_s(pid) - cpu0
    paced = {
        "token_interval_ms": cfg.paced_interval_ms,
        "streams": streams,
        "chunks": chunks,
        "router_cpu_s": round(cpu, 4),
        "router_cpu_us_per_chunk": round(cpu * 1e6 / max(1, chunks), 1),
        "router_cpu_ms_per_32_token_request": round(cpu * 1000 / streams, 2),
    }
    _log(
        f"paced ({cfg.paced_interval_ms:g} ms per token): {chunks} chunks, router CPU "
        f"{paced['router_cpu_us_per_chunk']:.0f} µs per chunk, "
        f"{paced['router_cpu_ms_per_32_token_request']:.2f} ms per 32-token request"
    )
    return paced


def _async_redis(url: str) -> Any:
    import redis.asyncio as aioredis

    return aioredis.from_url(url)
