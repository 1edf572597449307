"""`tandem bench admission`: what admission costs a request, and how many requests/s the router carries.

1. Fast path, in-process against the real Redis: exactly what the router does for a keyed request
   before routing: one Lua call that authenticates the key and charges requests/min, one that charges
   tokens/min (tenant and global layers, all four buckets live), one read of the session's history
   (a 6-turn agent session, from the region's Redis cache), and an uncontended node slot. Per request
   in microseconds (p50, p99, max). The store is a throwaway SQLite file: after warm-up every key and
   session read is served by Redis, as in steady state. Target: p99 under 2 ms.
2. Router requests/s: the real router (``tandem router``, its own process, uvicorn on loopback, real
   HTTP, telemetry on) in front of a STAND-IN engine (``bench.standin_engine``, its own process: no
   model, a fixed reply at once), so only the router's own work is measured: auth, limits, tokenizing
   with the served model's tokenizer (when it is prepared), routing, admission slot, SSE relay, the
   turn recorded after each answer. Closed loop: each of ``concurrency`` clients runs 4-turn agent
   conversations (full history re-sent each turn, its own ``x-session-id``), streaming. The load
   generator, the router and the stand-in share this machine's cores.

JSON at ``--out``, a PNG beside it; last line ``RESULT admit_p50_us=... admit_p99_us=... router_rps=...``
(``router_rps``: the best requests/s over the concurrency levels).

    python -m bench.admission --out results/bench-admission.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
import uvloop

from bench.host import host_record
from bench.loadgen import one_request, percentile
from bench.procs import router_command
from bench.standin_engine import STANDIN_LABEL, free_port
from contracts.config import redis_url as configured_redis_url
from contracts.errors import ConfigError
from contracts.registry import NodeInfo, NodeRegistry, Role
from node_agent.model import default_model_dir
from router.admission.context import AdmissionContext, AdmissionSettings
from router.admission.priority_class import Priority
from router.sessions import FunctionCall, Message, ToolCall, Turn, Usage

TURNS = 6
TARGET_P99_US = 2000.0
BIG = 10**12
"""A limit no benchmark reaches: the buckets are charged (0 would mean unlimited, untouched)."""
STANDIN_TEXT = "stand-in reply"


@dataclass(frozen=True)
class AdmissionBenchConfig:
    redis_url: str = field(default_factory=lambda: configured_redis_url(db=7))
    """$TANDEM_REDIS_URL's server, database 7: the benchmark's own."""
    """Redis for keys, limits, sessions, the registry and telemetry streams of the run (all removed
    afterwards: a unique key prefix, a unique model name, the telemetry streams of this DB)."""
    n: int = 5000
    """Fast-path samples (after ``warmup``)."""
    warmup: int = 200
    concurrencies: tuple[int, ...] = (1, 8, 32)
    requests_per_level: int = 1500
    router_warmup: int = 100


# -- 1. the fast path in-process ---------------------------------------------------------------------
async def _fast_path(cfg: AdmissionBenchConfig, prefix: str) -> tuple[dict[str, Any], list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = AdmissionSettings(
            redis_url=cfg.redis_url,
            key_prefix=prefix,
            region="local",
            region_cache_urls={},
            database_url=f"sqlite:///{tmp}/bench.db",
            global_rpm=BIG,
            global_tpm=BIG,
        )
        ctx = await AdmissionContext.create(settings)
        try:
            _, key = await ctx.keys.create_key("bench", rpm=BIG, tpm=BIG)
            header = f"Bearer {key}"
            for i in range(TURNS):
                ctx.sessions.record_turn(
                    Turn(
                        turn_id=f"t{i}",
                        session_id="s-bench",
                        tenant_id="bench",
                        created_at=float(i),
                        messages=[Message(role="user", content="explain this function " * 20)],
                        response=Message(
                            role="assistant",
                            content="it reads the file " * 30,
                            tool_calls=[ToolCall(id=f"c{i}", function=FunctionCall("read_file", '{"p":"x.py"}'))],
                        ),
                        usage=Usage(prompt_tokens=900, completion_tokens=120, total_tokens=1020),
                    )
                )
            await ctx.sessions.flush()
            samples: list[float] = []
            cpu0 = 0.0
            for i in range(cfg.warmup + cfg.n):
                if i == cfg.warmup:
                    cpu0 = time.process_time()
                t0 = time.perf_counter_ns()
                admission = await ctx.gate.admit(header, priority_header=None)
                await ctx.gate.charge_tokens(admission, 900, 256)
                history = await ctx.sessions.get_history(admission.tenant.tenant_id, "s-bench")
                async with ctx.controller.slot("node-0", admission.priority, time.monotonic() + 30):
                    t1 = time.perf_counter_ns()
                if len(history) != TURNS or admission.priority is not Priority.INTERACTIVE:
                    raise RuntimeError(f"session read returned {len(history)} turns, expected {TURNS}")
                if i >= cfg.warmup:
                    samples.append((t1 - t0) / 1000)
            cpu_us = (time.process_time() - cpu0) * 1e6 / cfg.n
        finally:
            await ctx.close()
    samples.sort()
    return {
        "what": "auth + requests/min (one Lua call) + tokens/min (one Lua call), tenant and global buckets; "
        "session read (Redis hash, 6 turns); free node slot. In-process, real Redis, on uvloop "
        "(the router's loop under uvicorn).",
        "redis_url": cfg.redis_url,
        "n": cfg.n,
        "admit_p50_us": round(statistics.median(samples), 1),
        "admit_p99_us": round(percentile(samples, 0.99), 1),
        "admit_max_us": round(samples[-1], 1),
        "admit_mean_us": round(statistics.fmean(samples), 1),
        "client_cpu_us_per_request": round(cpu_us, 1),
        "client_cpu_note": "CPU time of this process per request (Python side, not Redis): a figure that the "
        "machine's load does not inflate, unlike the wall-clock percentiles",
    }, samples


# -- 2. the router over a stand-in engine ------------------------------------------------------------
@contextlib.contextmanager
def _process(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # a child process offers no readiness callback
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise ConfigError(f"{url} did not become ready (exit code {proc.poll()}):\n{tail}")


async def _level(url: str, model: str, key: str, concurrency: int, n: int, warmup: int) -> dict[str, Any]:
    """``concurrency`` clients, closed loop, 4-turn conversations; ``warmup`` requests, then ``n`` timed."""
    run = uuid.uuid4().hex[:8]
    counter = itertools.count()
    latencies: list[float] = []
    errors: list[str] = []
    limit = warmup + n
    timed_start: list[float] = []

    async def client_loop(client: httpx.AsyncClient, worker: int) -> None:
        for conversation in itertools.count():
            session = f"bench-{run}-{worker}-{conversation}"
            messages: list[dict[str, str]] = [{"role": "system", "content": "You are a coding agent. Be brief."}]
            for turn in range(4):
                k = next(counter)
                if k >= limit:
                    return
                if k == warmup:
                    timed_start.append(time.perf_counter())
                messages.append({"role": "user", "content": f"step {turn}: what does function f{worker} do?"})
                body = {
                    "model": model,
                    "messages": messages,
                    "max_tokens": 16,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                headers = {"Authorization": f"Bearer {key}", "x-session-id": session}
                t0 = time.perf_counter()
                result = await one_request(client, "/v1/chat/completions", body, headers)
                if k >= warmup:
                    latencies.append(time.perf_counter() - t0)
                    if not result.ok:
                        errors.append(result.error or "?")
                messages.append({"role": "assistant", "content": STANDIN_TEXT})

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60, connect=10), limits=limits) as client:
        await asyncio.gather(*(client_loop(client, w) for w in range(concurrency)))
    wall = time.perf_counter() - timed_start[0]
    return {
        "concurrency": concurrency,
        "requests": n,
        "errors": len(errors),
        "first_errors": errors[:3],
        "wall_s": round(wall, 3),
        "rps": round(n / wall, 1),
        "latency_p50_ms": round(percentile(latencies, 0.5) * 1000, 2),
        "latency_p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
    }


async def _register(redis_url: str, node: NodeInfo, *, remove: bool = False) -> None:
    r = aioredis.Redis.from_url(redis_url)
    try:
        reg = NodeRegistry(r, ttl_s=3600)
        await (reg.deregister(node.node_id) if remove else reg.register(node))
    finally:
        await r.aclose()


async def _create_key(settings: AdmissionSettings) -> str:
    ctx = await AdmissionContext.create(settings, start_writer=False)
    try:
        return (await ctx.keys.create_key("bench-router", rpm=BIG, tpm=BIG))[1]
    finally:
        await ctx.close()


def _router_rps(cfg: AdmissionBenchConfig, prefix: str, tmp: Path) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    model = f"standin-noop-{tag}"
    engine_port, router_port = free_port(), free_port()
    model_dir = default_model_dir()
    tokenizes = model_dir.is_dir()
    node = NodeInfo(
        node_id=f"standin-{tag}",
        role=Role.BOTH,
        model=model,
        url=f"http://127.0.0.1:{engine_port}",
        block_size=16,
        max_model_len=8192,
        kv_connector="none",
        model_path=str(model_dir) if tokenizes else None,
    )
    db = f"sqlite:///{tmp}/router.db"
    env = {
        **os.environ,
        "TANDEM_KEY_PREFIX": prefix,
        "TANDEM_DATABASE_URL": db,
        "TANDEM_REGION": "local",
        "TANDEM_REGION_CACHE_URLS": "{}",
        "TANDEM_GLOBAL_RPM": str(BIG),
        "TANDEM_GLOBAL_TPM": str(BIG),
        "TANDEM_ROUTER_TELEMETRY": "true",
        "TANDEM_ROUTER_TELEMETRY_REDIS_URL": cfg.redis_url,
    }
    settings = AdmissionSettings(
        redis_url=cfg.redis_url, key_prefix=prefix, database_url=db, region="local", region_cache_urls={}
    )
    key = asyncio.run(_create_key(settings))
    levels = []
    engine_log, router_log = tmp / "standin-engine.log", tmp / "router.log"
    with _process([sys.executable, "-m", "bench.standin_engine", "--port", str(engine_port)], engine_log) as eng:
        _wait_http(f"{node.url}/health", eng, engine_log)
        asyncio.run(_register(cfg.redis_url, node))
        try:
            cmd = [*router_command(router_port, cfg.redis_url), "--log-level", "warning"]
            with _process(cmd, router_log, env) as router:
                url = f"http://127.0.0.1:{router_port}"
                _wait_http(f"{url}/health", router, router_log)
                for c in cfg.concurrencies:
                    cpu0 = _cpu_s(router.pid)
                    level = asyncio.run(_level(url, model, key, c, cfg.requests_per_level, cfg.router_warmup))
                    # warm-up included: the router's CPU per request, whatever the machine's load
                    level["router_cpu_ms_per_request"] = round(
                        (_cpu_s(router.pid) - cpu0) * 1000 / (cfg.requests_per_level + cfg.router_warmup), 2
                    )
                    print(
                        f"router c={c:<3} {level['rps']:8.1f} req/s  p50 {level['latency_p50_ms']:7.2f} ms  "
                        f"p99 {level['latency_p99_ms']:7.2f} ms  router CPU "
                        f"{level['router_cpu_ms_per_request']:.2f} ms/req  errors {level['errors']}",
                        file=sys.stderr,
                        flush=True,
                    )
                    levels.append(level)
        finally:
            asyncio.run(_register(cfg.redis_url, node, remove=True))
    best = max(levels, key=lambda lv: lv["rps"])
    return {
        "engine": STANDIN_LABEL,
        "what": "requests/s through the real router process (uvicorn, loopback HTTP, telemetry on, API key, "
        "x-session-id, turns recorded) over a STAND-IN engine that answers at once; closed loop, "
        "4-turn streamed conversations; client, router and stand-in share the machine",
        "router_tokenizes": tokenizes,
        "levels": levels,
        "router_rps": best["rps"],
        "router_rps_concurrency": best["concurrency"],
    }


async def _cleanup(redis_url: str, prefix: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}*", count=1000)]
        # The router's telemetry streams and response index (this DB is the benchmark's own).
        for pattern in ("tandem:telemetry:*", "tandem:response:*"):
            keys += [k async for k in r.scan_iter(match=pattern, count=1000)]
        if keys:
            await r.delete(*keys)
    finally:
        await r.aclose()


# -- output ------------------------------------------------------------------------------------------
def plot(doc: dict[str, Any], samples_us: list[float], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fast, router = doc["admission_fast_path"], doc["router"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    lo, hi = max(1.0, min(samples_us)), max(samples_us)
    bins = [lo * (hi / lo) ** (i / 80) for i in range(81)]  # log-spaced, to match the log axis
    left.hist(samples_us, bins=bins, color="#4c72b0")
    for x, label, style in (
        (fast["admit_p50_us"], "p50", "--"),
        (fast["admit_p99_us"], "p99", "-."),
        (TARGET_P99_US, "target p99", ":"),
    ):
        left.axvline(x, color="k", linestyle=style, label=f"{label} {x:,.0f} µs")
    left.set_xscale("log")
    left.set_xlabel("µs per request (log)")
    left.set_ylabel("requests")
    left.set_title("Admission fast path: auth + limits + session read + slot")
    left.legend()
    xs = [str(lv["concurrency"]) for lv in router["levels"]]
    right.bar(xs, [lv["rps"] for lv in router["levels"]], color="#55a868")
    for i, lv in enumerate(router["levels"]):
        right.annotate(
            f"{lv['rps']:.0f}/s\np99 {lv['latency_p99_ms']:.0f} ms",
            (i, lv["rps"]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    right.set_ylim(0, 1.25 * max(lv["rps"] for lv in router["levels"]))
    right.set_xlabel("concurrent clients")
    right.set_ylabel("requests/s")
    right.set_title("Router requests/s over a no-op STAND-IN engine")
    host = doc["host"]
    fig.suptitle(
        f"tandem bench admission ({host['cpus']} cores, load average {host['loadavg_1m_before']}"
        f" → {host['loadavg_1m_after']})"
    )
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def run_admission_bench(out: Path, cfg: AdmissionBenchConfig | None = None) -> dict[str, Any]:
    """Run both parts, write ``out`` (JSON) and a PNG beside it; return the RESULT figures. Prints
    progress on stderr and nothing on stdout (the caller prints the RESULT line)."""
    cfg = cfg or AdmissionBenchConfig()
    prefix = f"bench-{uuid.uuid4().hex[:8]}:"
    load_before = os.getloadavg()
    try:
        # The router serves on uvicorn's default loop, which is uvloop when installed (it is a
        # dependency): measure the fast path on the same loop.
        fast, samples = uvloop.run(_fast_path(cfg, prefix))
        print(f"fast path: p50 {fast['admit_p50_us']} µs  p99 {fast['admit_p99_us']} µs", file=sys.stderr)
        with tempfile.TemporaryDirectory() as tmp:
            router = _router_rps(cfg, prefix, Path(tmp))
    finally:
        asyncio.run(_cleanup(cfg.redis_url, prefix))
    result = {
        "admit_p50_us": fast["admit_p50_us"],
        "admit_p99_us": fast["admit_p99_us"],
        "router_rps": router["router_rps"],
    }
    doc = {
        "benchmark": "admission",
        "time": time.time(),
        "host": host_record(load_before),
        "config": cfg.__dict__,
        "admission_fast_path": fast,
        "router": router,
        "target": {"admit_p99_us_below": TARGET_P99_US, "met": fast["admit_p99_us"] < TARGET_P99_US},
        "result": result,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(doc, samples, png)
    print(f"wrote {out} and {png}", file=sys.stderr, flush=True)
    return result


def result_line(result: dict[str, Any]) -> str:
    return (
        f"RESULT admit_p50_us={result['admit_p50_us']} admit_p99_us={result['admit_p99_us']} "
        f"router_rps={result['router_rps']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", default=AdmissionBenchConfig.redis_url)
    parser.add_argument("-n", type=int, default=AdmissionBenchConfig.n)
    parser.add_argument("--out", type=Path, default=Path("results/bench-admission.json"))
    args = parser.parse_args()
    result = run_admission_bench(args.out, AdmissionBenchConfig(redis_url=args.redis, n=args.n))
    print(result_line(result), flush=True)


if __name__ == "__main__":
    main()
