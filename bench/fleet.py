"""``tandem bench fleet --nodes N``: Tandem against vllm-router on the same engines, as a user's fleet of
colocated nodes serves coding-agent sessions.

Arms, each on fresh engines with the same ``vllm serve`` command line (``node_agent.node.engine_command``
for one colocated node, one core slice each, ``infra.launcher.assign_cores``):

    tandem                 ``tandem up --both N`` as a user gets it (its defaults; the shared cache by
                           ``infra.shared_cache``'s rule: off below four nodes)
    tandem_tier            the same with a host tier every node shares and peer fetch
                           (``--host-tier``, ``--peer-kv``)
    vllm_router_cache_aware   vllm-router 0.1.17 ``--policy cache_aware`` over N plain engines
    vllm_router_round_robin   the same with ``--policy round_robin``

A plain engine is the node's command line without Tandem's start-up hooks (``kv_transfer.engine_hooks``):
stock vLLM, as vllm-router's users run it. Rounds alternate the arm order (as listed, then reversed);
every round has new content (a salt in the shared system prompt) and every arm in a round the same
requests, under its own session ids.

Workload (``bench.agent_workload``): sessions over repositories whose context they share, a fixed
number of turns each, the agent's tool pauses between turns (exponential, capped at ``max_think_s``),
at most ``concurrency`` sessions at once (an agent pool), all queued at the start, streamed.

Per arm (requests of the main rounds pooled; the two Tandem arms also over every round, ``tandem_pooled``):
    hit                 engine-confirmed cached prompt tokens over prompt tokens
    ttft p50/p99, e2e p50, client ITL p50/p99 (gaps between content chunks as the client reads them)
    engine ITL p50/mean vLLM's own ``vllm:inter_token_latency_seconds`` histogram, the difference of each
                        engine's /metrics across the run, summed over the engines (p50 interpolated
                        inside vLLM's buckets); client minus engine is what the path between them adds
    sessions_per_min    sessions whose every turn succeeded, per minute of the arm's wall time
    non_engine_cpu_s    CPU seconds of every process of the arm that is not an engine, over the run:
                        routers, node agents, lake writer, host tier, the arm's own Redis; vllm-router.
    outside_cpu_s       CPU seconds the host spent outside the benchmark meanwhile (others' work): a run
                        that lost its cores to it is told apart from one that was slow by itself.

Targets (issue 37), Tandem's defaults against vllm-router ``cache_aware`` over the main rounds:
sessions per minute >= 1.10x, client ITL p50 <= 1.05x, TTFT p99 <= 0.8x, hit >= +0.03; and the
defaults arm at least as good as the tier arm (sessions per minute within ``TIER_TOLERANCE``) over
every round of the two, the main ones and ``tier_rounds`` more of those two arms alone
(``bench.fleet_figures`` says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.agent_workload import AgentWorkloadConfig, build_sessions
from bench.fleet_figures import (
    BASELINE,
    TANDEM_ARMS,
    TIER_CHECK,
    TIER_TOLERANCE,
    RunRecord,
    plot,
    requests_of,
    result_line,
    summarize,
    targets,
)
from bench.histograms import diff_buckets, histogram_quantile, parse_histogram
from bench.host import host_probe
from bench.loadgen import run_sessions
from bench.procs import outside_cpu_s, sched_cpu_s, served_model, wait_http
from bench.routing import _Tokens
from bench.vllm_router import PeerWorker, VllmRouter
from contracts.config import redis_url as configured_redis_url
from contracts.registry import Role
from contracts.secret import engine_auth_headers
from infra.launcher import Cluster, ClusterSpec, assign_cores
from infra.shared_cache import shared_cache_default
from kv_transfer import ENGINE_HOOKS
from node_agent.node import EngineProcess, engine_env
from node_agent.settings import NodeSettings

ARMS = ("tandem", "tandem_tier", "vllm_router_cache_aware", "vllm_router_round_robin")
ITL_METRIC = "vllm:inter_token_latency_seconds"


def _workload() -> AgentWorkloadConfig:
    # Issue 37's shape: three repositories sharing ~1.5k tokens of context (system + repository),
    # four turns, tool pauses; sized so that eight arm runs take about 20 minutes on a 2-core host.
    return AgentWorkloadConfig(
        repos=3,
        sessions_per_repo=3,
        turns_min=4,
        turns_max=4,
        system_tokens=250,
        repo_tokens=1250,
        tool_tokens=(40, 120),
        reply_tokens=(15, 35),
        think_s=1.0,
    )


@dataclass(frozen=True)
class FleetBenchConfig:
    nodes: int = 2
    rounds: int = 2
    arms: tuple[str, ...] = ARMS
    tier_rounds: int = 4
    """Extra rounds of the two Tandem arms alone, after the main rounds (``bench.fleet_figures``: their
    difference is smaller than one round's spread); the defaults-against-tier check pools every round."""
    workload: AgentWorkloadConfig = field(default_factory=_workload)
    concurrency: int = 4
    """Sessions in flight at once (the agent pool)."""
    max_tokens: int = 24
    max_think_s: float = 2.0
    host_tier: str = "2GiB"
    """The tier arm's host tier size."""
    kv_cache_gib: int = 1
    routers: int | None = None
    """Router replicas of the Tandem arms; None: ``tandem up``'s default for this host."""
    model: str | None = None
    port_base: int = 19700
    """Engines use port_base + 10 * i, routers port_base + 50 (vllm-router's metrics + 51), Redis + 60."""
    redis_url: str | None = None
    """Registry Redis of the Tandem arms; None: one of each arm's own (port_base + 60), so nothing else
    on the host's Redis (a test's FLUSHDB of a shared database) takes a cluster's registry mid-run."""
    workdir: Path = Path(".tandem/bench-fleet")


# -- arms ------------------------------------------------------------------------------------------------
@dataclass
class Served:
    url: str
    model: str
    engines: list[str]
    """Engine base URLs (their /metrics hold vLLM's histograms)."""
    others: dict[str, int]
    """Name -> pid of every process of the arm that is not an engine."""
    engine_command: list[str]


def _log(msg: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _node_settings(cfg: FleetBenchConfig, i: int, logs: Path) -> NodeSettings:
    return NodeSettings(
        role=Role.BOTH,
        port=cfg.port_base + 10 * i,
        cores=assign_cores(Role.BOTH, False, i, cfg.nodes),
        kv_cache_gib=cfg.kv_cache_gib,
        model=cfg.model,
        log_dir=logs,
        node_id=f"plain-{cfg.port_base + 10 * i}",
        engine_auth=False,
        redis_url=cfg.redis_url or configured_redis_url(),  # unused: a plain engine registers nowhere
    )


def plain_env(settings: NodeSettings) -> dict[str, str]:
    """The node's engine environment without Tandem's start-up hooks: stock vLLM on the same cores."""
    env = engine_env(settings)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ENGINE_HOOKS)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for key in ("TANDEM_ENGINE_SPIN_MS", "TANDEM_NIXL_PROGRESS_THREAD"):
        env.pop(key, None)
    return env


def _alive(engine: EngineProcess) -> Callable[[], bool]:
    return lambda: engine.exited() is None


def fresh_arm_state(workdir: Path, tag: str) -> tuple[Path, Path]:
    """The cluster folder and router database of one Tandem arm and round, emptied of an earlier run's:
    each arm's lake then holds that arm's requests only (a lake kept across runs mixed every run's
    rows under one ``cluster-<tag>``), and its router starts without an earlier run's stored responses."""
    cluster, db = workdir / f"cluster-{tag}", workdir / f"router-{tag}.db"
    shutil.rmtree(cluster, ignore_errors=True)
    db.unlink(missing_ok=True)
    return cluster, db


@contextlib.contextmanager
def serve_arm(arm: str, cfg: FleetBenchConfig, tag: str) -> Iterator[Served]:
    """Start one arm on fresh processes; everything it started is stopped on exit."""
    logs = cfg.workdir / "logs" / tag
    router_port = cfg.port_base + 50
    if arm.startswith("vllm_router_"):
        engines = [EngineProcess(s, env=plain_env(s)) for s in (_node_settings(cfg, i, logs) for i in range(cfg.nodes))]
        try:
            for e in engines:
                e.start()
            for e in engines:
                wait_http(f"{e.settings.url}/health", _alive(e))
            urls = [e.settings.url for e in engines]
            model = served_model(urls[0])
            with VllmRouter(
                port=router_port,
                policy=arm.removeprefix("vllm_router_"),
                workers=[PeerWorker(u, "", "") for u in urls],
                block_size=128,
                model=model,
                log=logs / "vllm-router.log",
                metrics_port=router_port + 1,
            ) as peer:
                if peer.proc is None:
                    raise RuntimeError("vllm-router did not start")
                args = engines[0].proc.args if engines[0].proc is not None else []
                line = [str(a) for a in args] if isinstance(args, list) else [str(args)]
                yield Served(peer.url, model, urls, {"vllm-router": peer.proc.pid}, line)
        finally:
            for e in engines:
                e.stop()
        return
    tier = arm == "tandem_tier"
    cluster_dir, router_db = fresh_arm_state(cfg.workdir, tag)
    default = shared_cache_default(cfg.nodes)  # the defaults arm gets what `tandem up` gives a user
    spec = ClusterSpec(
        prefill=0,
        decode=0,
        both=cfg.nodes,
        model=cfg.model,
        router_port=router_port,
        node_base_port=cfg.port_base,
        redis_url=cfg.redis_url,
        embedded_redis=cfg.redis_url is None,
        redis_port=cfg.port_base + 60,
        kv_cache_gib=cfg.kv_cache_gib,
        routers=cfg.routers,
        workdir=cluster_dir,
        router_env=(("TANDEM_DATABASE_URL", f"sqlite:///{router_db.resolve()}"),),
        host_tier=cfg.host_tier if tier else default.host_tier,
        peer_kv=tier or default.peer_kv,
    )
    with Cluster(spec) as cluster:
        urls = cluster.role_urls("both")
        others = {name: p.pid for name, p in cluster.procs if name != "redis" or cfg.redis_url is None}
        command: list[str] = []
        with contextlib.suppress(psutil.Error, StopIteration, IndexError):  # recorded only
            agent = next(p for name, p in cluster.procs if name.startswith("both"))
            command = psutil.Process(agent.pid).children()[0].cmdline()
        yield Served(cluster.url, served_model(urls[0]), urls, others, command)


def _scrape(served: Served) -> tuple[dict[float, float], float, dict[str, float]]:
    buckets: dict[float, float] = {}
    total = 0.0
    for url in served.engines:
        text = httpx.get(f"{url}/metrics", headers=engine_auth_headers(loopback_only=True), timeout=10).text
        b, s, _ = parse_histogram(text, ITL_METRIC)
        for k, c in b.items():
            buckets[k] = buckets.get(k, 0.0) + c
        total += s
    cpu = {name: sched_cpu_s(pid) for name, pid in served.others.items()}
    return buckets, total, cpu


def _warm(served: Served) -> None:
    """One short request on each engine and one through the front door: no arm's first measured
    request pays an engine's first step."""
    body = {"model": served.model, "max_tokens": 2, "messages": [{"role": "user", "content": "warm up"}]}
    for url in served.engines:
        httpx.post(
            f"{url}/v1/chat/completions", json=body, headers=engine_auth_headers(loopback_only=True), timeout=300
        ).raise_for_status()
    httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=300).raise_for_status()


# -- the run ---------------------------------------------------------------------------------------------
def round_plan(cfg: FleetBenchConfig) -> list[tuple[int, tuple[str, ...]]]:
    """Each round and its arms in order: the main rounds run every arm, then ``tier_rounds`` run the two
    Tandem arms alone (when both are asked for); the order alternates from round to round."""
    plan = [(rnd, cfg.arms if rnd % 2 == 0 else tuple(reversed(cfg.arms))) for rnd in range(cfg.rounds)]
    pair = tuple(a for a in cfg.arms if a in TANDEM_ARMS)
    if len(pair) == 2:
        for rnd in range(cfg.rounds, cfg.rounds + cfg.tier_rounds):
            plan.append((rnd, pair if rnd % 2 == 0 else pair[::-1]))
    return plan


def run_fleet_bench(out: Path, cfg: FleetBenchConfig | None = None) -> dict[str, Any]:
    cfg = cfg or FleetBenchConfig()
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = _Tokens(cfg.model)
    nonce = uuid.uuid4().hex[:6]
    runs: list[RunRecord] = []
    commands: dict[str, list[str]] = {}
    load, probe = {"before": os.getloadavg()}, host_probe()
    _log(f"host: {probe}")
    for rnd, order in round_plan(cfg):
        salt = f"fleet-{nonce}-r{rnd}"
        scripts = build_sessions(cfg.workload, salt, tokens.text, lambda m: len(tokens.prompt(m)))
        scripts = [
            dataclasses.replace(s, start_s=0.0, think_s=[min(t, cfg.max_think_s) for t in s.think_s]) for s in scripts
        ]
        for arm in order:
            tag = f"r{rnd}-{arm}"
            _log(f"{tag}: starting (load {os.getloadavg()[0]:.2f})")
            with serve_arm(arm, cfg, tag) as served:
                commands[arm] = served.engine_command
                _warm(served)
                mine = [dataclasses.replace(s, session_id=f"{s.session_id}-{arm}") for s in scripts]
                buckets0, sum0, cpu0 = _scrape(served)
                start, outside = time.perf_counter(), outside_cpu_s()
                sent = asyncio.run(
                    run_sessions(served.url, served.model, mine, cfg.max_tokens, max_sessions=cfg.concurrency)
                )
                wall, outside = time.perf_counter() - start, outside_cpu_s() - outside
                buckets1, sum1, cpu1 = _scrape(served)
            record = RunRecord(
                arm=arm,
                round=rnd,
                sent=sent,
                sessions=len(mine),
                wall_s=wall,
                engine_itl_buckets=diff_buckets(buckets0, buckets1),
                engine_itl_sum_s=sum1 - sum0,
                non_engine_cpu_s={k: round(cpu1[k] - cpu0.get(k, 0.0), 3) for k in cpu1},
                outside_cpu_s=outside,
            )
            runs.append(record)
            one = summarize([record])
            _log(
                f"{tag}: {one['wall_s']} s, {one['sessions_per_min']} sessions/min, hit {one['hit']}, "
                f"TTFT p50/p99 {one['ttft_p50_ms']}/{one['ttft_p99_ms']} ms, ITL client/engine "
                f"{one['client_itl_p50_ms']}/{one['engine_itl_p50_ms']} ms, errors {one['errors']}, "
                f"outside CPU {one['outside_cpu_s']} s"
            )
            partial = {"partial": True, "runs": {f"r{r.round}-{r.arm}": summarize([r]) for r in runs}}
            out.with_suffix(".partial.json").write_text(json.dumps(partial, indent=2, default=str))
    load["after"] = os.getloadavg()
    arms = {arm: summarize([r for r in runs if r.arm == arm and r.round < cfg.rounds]) for arm in cfg.arms}
    pooled = {arm: summarize([r for r in runs if r.arm == arm]) for arm in TANDEM_ARMS if arm in cfg.arms}
    result = {
        "config": {**dataclasses.asdict(cfg), "workdir": str(cfg.workdir)},
        "host": {"cores": len(os.sched_getaffinity(0)), "loadavg": load, **probe},
        "engine_commands": commands,
        "arms": arms,
        "tandem_pooled": pooled,
        "per_run": {f"r{r.round}-{r.arm}": summarize([r]) for r in runs},
        "requests": {f"r{r.round}-{r.arm}": requests_of(r) for r in runs},
        "targets": targets(arms, pooled),
    }
    out.write_text(json.dumps(result, indent=2, default=str))
    with contextlib.suppress(FileNotFoundError):
        out.with_suffix(".partial.json").unlink()
    plot(arms, out.with_suffix(".png"))
    return result


__all__ = [
    "ARMS",
    "BASELINE",
    "TIER_CHECK",
    "TIER_TOLERANCE",
    "FleetBenchConfig",
    "RunRecord",
    "diff_buckets",
    "histogram_quantile",
    "parse_histogram",
    "plain_env",
    "plot",
    "requests_of",
    "result_line",
    "round_plan",
    "run_fleet_bench",
    "summarize",
    "targets",
]
