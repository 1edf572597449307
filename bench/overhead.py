"""``tandem bench overhead``: what Tandem costs over the vLLM it wraps, on the same cores, in one run.

Four arms serve the same workload, each on a fresh engine with the node's exact ``vllm serve`` flags
(``node_agent.node.engine_command``) on every core of this machine:

    plain    the engine alone, started as ``vllm serve`` (no node agent, no pinning): the ceiling
    peer     vllm-router (``cache_aware``, its best policy on plain workers) in front of a plain engine
    node     a Tandem colocated node (agent + pinning), the load sent straight to its engine port
    tandem   ``tandem up --colocated``: the load through the Tandem router (telemetry, admission,
             routing keys, lake writer all on, as a user gets them)

Load, per arm and round:
    1. ``vllm bench serve`` (vLLM's own client, a real external one): random prompts of
       ``input_len`` tokens, ``output_len`` tokens out (``--ignore-eos``), ``num_prompts`` at
       ``concurrency``; a new seed for every arm and round, so no run reuses another's cache.
    2. Our agent workload (multi-turn sessions that resend a growing context, SSE), a new salt for
       every arm and round.
Rounds alternate the arm order (plain, peer, node, tandem, then reversed). Router CPU per request is
the CPU time of the router processes (every replica, every thread, from the scheduler's nanosecond
counters: ``bench.procs.ThreadCpu``) over the ``vllm bench serve`` part divided by its requests
(background work included: a router that idles expensively pays for it here).

The router's own ceiling: SSE chunks relayed per second with the router on one core, over the labelled
STAND-IN engine (``bench.standin_engine``, token-streaming mode) on the other core, many streams at
once, no engine cost: agent traffic is mostly small chunks, and every one crosses the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.host import host_probe, host_record
from bench.loadgen import percentile
from bench.overhead_report import ARMS, plot, summarize, targets
from bench.procs import ThreadCpu, served_model, wait_http
from bench.router_ceiling import router_ceiling
from contracts.config import redis_url as configured_redis_url
from contracts.errors import ConfigError
from contracts.registry import Role
from infra.launcher import Cluster, ClusterSpec
from node_agent.model import resolve_model
from node_agent.node import EngineProcess
from node_agent.settings import NodeSettings


@dataclass(frozen=True)
class OverheadBenchConfig:
    rounds: int = 2
    num_prompts: int = 64
    concurrency: int = 16
    input_len: int = 512
    output_len: int = 64
    agent_sessions: int = 4
    """Agent workload: sessions (2 repositories), 3-4 turns each, 32 tokens out; 0 skips it."""
    arms: tuple[str, ...] = ARMS
    kv_cache_gib: int = 1
    routers: int = 1
    """Router replicas of the Tandem arm: one router process against the peer's one vllm-router
    process. ``tandem up`` runs two for availability; each costs its idle work (``--routers 2``
    measures that configuration)."""
    redis_url: str = field(default_factory=lambda: configured_redis_url(db=11))
    """Registry of the Tandem arms (a database of its own, so no other node is in the fleet)."""
    port_base: int = 19400
    ceiling_streams: int = 64
    ceiling_tokens: int = 1500
    """Router ceiling: concurrent streams over the stand-in, and chunks per stream."""
    ceiling_rounds: int = 3
    paced_interval_ms: float = 100.0
    """Router CPU per chunk when chunks come one at a time, as from an engine decoding one token per
    ``paced_interval_ms`` (this 2-core host's engine takes 100-150 ms): 16 streams of 32 tokens over a
    paced stand-in. The ceiling's streams arrive in bursts, so many chunks share one read and one write."""
    workdir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "tandem-bench-overhead")


def _log(msg: str) -> None:
    print(f"[overhead {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _cores() -> str:
    cores = sorted(os.sched_getaffinity(0))
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])


class _CpuMeter:
    """Samples the CPU seconds of one or more processes (every router replica; each runs in one process)
    every 100 ms in a thread, from the scheduler's nanosecond counters (``ThreadCpu``), so that their
    CPU over any window of the run can be read afterwards."""

    def __init__(self, *pids: int) -> None:
        import threading

        self._threads = [ThreadCpu(pid) for pid in pids]
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self._total()))
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic(), self._total()))

    def _total(self) -> float:
        return sum(t.total() for t in self._threads)

    def between(self, start: float, end: float) -> float:
        """CPU seconds used between two monotonic times (to the nearest samples)."""
        inside = [cpu for t, cpu in self.samples if start <= t <= end + 0.15]
        before = [cpu for t, cpu in self.samples if t < start]
        first = before[-1] if before else (inside[0] if inside else 0.0)
        return (inside[-1] - first) if inside else 0.0


@dataclass
class Served:
    """One arm, ready: where to send load, the model name, and the router process to meter."""

    url: str
    model: str
    router_pids: tuple[int, ...] = ()
    """Every router replica's process (their CPU is summed)."""


@contextlib.contextmanager
def _plain_engine(cfg: OverheadBenchConfig, port: int, logs: Path) -> Iterator[str]:
    settings = NodeSettings(
        role=Role.BOTH,
        port=port,
        cores=_cores(),
        kv_cache_gib=cfg.kv_cache_gib,
        log_dir=logs,
        node_id=f"plain-{port}",
        engine_auth=False,  # plain vLLM: no API key
        redis_url=cfg.redis_url,
    )
    engine = EngineProcess(settings)
    engine.start()
    try:
        wait_http(f"{settings.url}/health", lambda: engine.exited() is None)
        yield settings.url
    finally:
        engine.stop()


@contextlib.contextmanager
def serve_arm(arm: str, cfg: OverheadBenchConfig, slot: int) -> Iterator[Served]:
    """Start one arm on fresh processes; everything it started is stopped on exit."""
    port = cfg.port_base + 40 * slot
    logs = cfg.workdir / "logs"
    if arm in ("plain", "peer"):
        with _plain_engine(cfg, port, logs) as url:
            model = served_model(url)
            if arm == "plain":
                yield Served(url, model)
                return
            from bench.vllm_router import PeerWorker, VllmRouter

            with VllmRouter(
                port=port + 30,
                policy="cache_aware",
                block_size=128,
                model=model,
                log=logs / f"vllm-router-{port}.log",
                metrics_port=port + 31,
                workers=[PeerWorker(url, "", "")],
            ) as peer:
                assert peer.proc is not None
                yield Served(peer.url, model, router_pids=(peer.proc.pid,))
            return
    spec = ClusterSpec(
        prefill=0,
        decode=0,
        both=1,
        router_port=port + 30,
        node_base_port=port,
        redis_url=cfg.redis_url,
        kv_cache_gib=cfg.kv_cache_gib,
        routers=cfg.routers,
        workdir=cfg.workdir / f"cluster-{port}",
        router_env=(("TANDEM_DATABASE_URL", f"sqlite:///{cfg.workdir}/router-{port}.db"),),
        node_env=(("TANDEM_NODE_ENGINE_AUTH", "false"),) if arm == "node" else (),  # load goes to the engine
    )
    with Cluster(spec) as cluster:
        node_url = cluster.role_urls("both")[0]
        model = served_model(node_url)
        if arm == "node":
            yield Served(node_url, model)
        else:
            routers = tuple(p.pid for name, p in cluster.procs if name.startswith("router"))
            yield Served(cluster.url, model, router_pids=routers)


# -- load ---------------------------------------------------------------------------------------------
def vllm_bench_serve(served: Served, cfg: OverheadBenchConfig, seed: int, out_dir: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run (vLLM's own load client) against ``served``; its metrics."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"vllm-bench-{seed}.json"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--base-url",
        served.url,
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        served.model,
        "--tokenizer",
        str(resolve_model(None)),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(cfg.input_len),
        "--random-output-len",
        str(cfg.output_len),
        "--num-prompts",
        str(cfg.num_prompts),
        "--max-concurrency",
        str(cfg.concurrency),
        "--seed",
        str(seed),
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
        "--disable-tqdm",
    ]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    meter = _CpuMeter(*served.router_pids) if served.router_pids else None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    ended = time.monotonic()
    if meter is not None:
        meter.stop()
    if proc.returncode != 0:
        raise ConfigError(f"vllm bench serve failed ({proc.returncode}): {proc.stderr[-2000:]}")
    data = json.loads((out_dir / name).read_text())
    completed = int(data.get("completed", 0))
    # The router's CPU over the benchmark's own window (its "duration", which ends just before the
    # client writes its result and exits), not over the client's start-up, when the router idles.
    window = float(data.get("duration") or 0.0)
    router_cpu = meter.between(ended - window - 1.0, ended) if meter is not None else None
    return {
        "seed": seed,
        "completed": completed,
        "failed": cfg.num_prompts - completed,
        "req_s": round(float(data["request_throughput"]), 3),
        "output_tok_s": round(float(data["output_throughput"]), 1),
        "ttft_p50_ms": round(float(data["median_ttft_ms"]), 1),
        "ttft_p99_ms": round(float(data["p99_ttft_ms"]), 1),
        "tpot_p50_ms": round(float(data["median_tpot_ms"]), 2),
        "router_cpu_ms_per_req": round(router_cpu * 1000 / max(1, completed), 2) if router_cpu is not None else None,
        "duration_s": round(window, 2),
    }


def agent_sessions(served: Served, cfg: OverheadBenchConfig, salt: str) -> dict[str, Any]:
    """Our agent workload against ``served``: multi-turn SSE sessions that resend a growing context."""
    from bench.agent_workload import AgentWorkloadConfig, build_sessions
    from bench.loadgen import run_sessions
    from bench.routing import _Tokens

    tokens = _Tokens(None)
    wl = AgentWorkloadConfig(
        repos=2,
        sessions_per_repo=max(1, cfg.agent_sessions // 2),
        turns_min=3,
        turns_max=4,
        repo_tokens=600,
        session_gap_s=0.5,
        think_s=0.2,
    )
    sessions = build_sessions(wl, salt, tokens.text, lambda m: len(tokens.prompt(m)))
    start = time.perf_counter()
    sent = asyncio.run(run_sessions(served.url, served.model, sessions, max_tokens=32))
    wall = time.perf_counter() - start
    ok = [s.result for s in sent if s.result.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "requests": len(sent),
        "failed": len(sent) - len(ok),
        "req_s": round(len(ok) / wall, 3),
        "ttft_p50_ms": round(percentile(ttfts, 0.5) * 1000, 1) if ttfts else None,
        "ttft_p99_ms": round(percentile(ttfts, 0.99) * 1000, 1) if ttfts else None,
    }


# -- the router's ceiling -------------------------------------------------------------------------------


# -- the run ---------------------------------------------------------------------------------------------


def run_overhead_bench(out: Path, cfg: OverheadBenchConfig | None = None) -> dict[str, float]:
    cfg = cfg or OverheadBenchConfig()
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    run_tag = int(time.time()) % 1_000_000
    load_before, probe = os.getloadavg(), host_probe()
    _log(f"host: {probe}")
    rounds = [_run_round(cfg, rnd, run_tag) for rnd in range(cfg.rounds)]
    _log("router ceiling over the stand-in engine")
    ceiling = router_ceiling(cfg)
    summary = summarize(rounds, cfg.arms)
    result = _result(summary, ceiling)
    doc = _document(cfg, rounds, summary, ceiling, result, host_record(load_before, probe))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(doc, png)
    _log(
        f"wrote {out} and {png}; targets: "
        + ", ".join(f"{k}: {'met' if v['met'] else 'MISSED'}" for k, v in doc["targets"].items())
    )
    return result


def _run_round(cfg: OverheadBenchConfig, rnd: int, run_tag: int) -> dict[str, Any]:
    """Every arm once on a fresh engine, in the configured order on even rounds and reversed on odd ones."""
    order = list(cfg.arms) if rnd % 2 == 0 else list(reversed(cfg.arms))
    arms: dict[str, Any] = {}
    for slot, arm in enumerate(order):
        seed = run_tag * 100 + rnd * 10 + ARMS.index(arm)
        _log(f"round {rnd + 1}/{cfg.rounds}: {arm} (starting a fresh engine)")
        with serve_arm(arm, cfg, slot) as served:
            res = {"vllm_bench": vllm_bench_serve(served, cfg, seed, cfg.workdir / "vllm-bench")}
            if cfg.agent_sessions:
                res["agent"] = agent_sessions(served, cfg, salt=f"overhead-{seed}")
        _log_arm(arm, res)
        arms[arm] = res
    return {"order": order, "arms": arms}


def _log_arm(arm: str, res: dict[str, Any]) -> None:
    v = res["vllm_bench"]
    _log(
        f"  {arm}: {v['req_s']:.2f} req/s, {v['output_tok_s']:.0f} tok/s, TTFT p50 {v['ttft_p50_ms']:.0f} ms "
        f"p99 {v['ttft_p99_ms']:.0f} ms, TPOT p50 {v['tpot_p50_ms']:.1f} ms"
        + (f", router CPU {v['router_cpu_ms_per_req']:.2f} ms/req" if v["router_cpu_ms_per_req"] else "")
        + (
            f"; agent {res['agent']['req_s']:.2f} req/s TTFT p50 {res['agent']['ttft_p50_ms']} ms"
            if res.get("agent")
            else ""
        )
    )


def _result(summary: dict[str, Any], ceiling: dict[str, Any]) -> dict[str, float]:
    """The RESULT line's figures."""
    return {
        "plain_rps": summary["plain"]["req_s"],
        "peer_rps": summary["peer"]["req_s"],
        "node_rps": summary["node"]["req_s"],
        "tandem_rps": summary["tandem"]["req_s"],
        "plain_ttft_p50_ms": summary["plain"]["ttft_p50_ms"],
        "tandem_ttft_p50_ms": summary["tandem"]["ttft_p50_ms"],
        "router_cpu_ms_per_req": summary["tandem"]["router_cpu_ms_per_req"],
        "router_chunks_per_s": ceiling["chunks_per_s"],
    }


def _document(
    cfg: OverheadBenchConfig,
    rounds: list[dict[str, Any]],
    summary: dict[str, Any],
    ceiling: dict[str, Any],
    result: dict[str, float],
    host: dict[str, Any],
) -> dict[str, Any]:
    """The JSON results: host, config, what each arm is, every round, the summary, ratios and targets."""
    doc: dict[str, Any] = {
        "benchmark": "overhead",
        "time": time.time(),
        "host": host,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "arms": {
            "plain": "vllm serve with the node's flags, all cores, no agent",
            "peer": "vllm-router 0.1.17 --policy cache_aware in front of a plain engine",
            "node": "tandem node (agent + thread pinning), load straight to its engine port",
            "tandem": "tandem up --colocated: load through the Tandem router",
        },
        "rounds": rounds,
        "summary": summary,
        "router_ceiling": ceiling,
        "result": result,
        "ratios": {
            "tandem/plain": round(result["tandem_rps"] / result["plain_rps"], 3),
            "tandem/peer": round(result["tandem_rps"] / result["peer_rps"], 3),
            "node/plain": round(result["node_rps"] / result["plain_rps"], 3),
            "tandem_ttft/plain_ttft": round(result["tandem_ttft_p50_ms"] / result["plain_ttft_p50_ms"], 3),
        },
    }
    doc["targets"] = targets(result)
    # A faster arm that refused requests is no faster: every arm must have answered everything.
    failed = {arm: s["failed"] + s.get("agent_failed", 0) for arm, s in summary.items()}
    doc["targets"]["every request answered in every arm"] = {"met": not any(failed.values()), "failed": failed}
    return doc
