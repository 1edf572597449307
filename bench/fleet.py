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

Per arm (requests of every round pooled):
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

Targets (issue 37), Tandem's defaults against vllm-router ``cache_aware``: sessions per minute
>= 1.10x, client ITL p50 <= 1.05x, TTFT p99 <= 0.8x, hit >= +0.03; and the defaults arm at least
as good as the tier arm (sessions per minute within ``TIER_TOLERANCE``).
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.agent_workload import AgentWorkloadConfig, build_sessions
from bench.charts import grouped_bars, save, subplots
from bench.histograms import diff_buckets, histogram_quantile, parse_histogram
from bench.host import host_probe
from bench.loadgen import SentRequest, percentile, run_sessions
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
BASELINE = "vllm_router_cache_aware"
TIER_TOLERANCE = 0.97
"""The defaults arm counts as equal to the tier arm down to this share of its sessions per minute."""
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


# -- one run's record and the summaries ----------------------------------------------------------------
@dataclass
class RunRecord:
    """What one arm's run measured: the client's requests and the counters read around the run."""

    arm: str
    round: int
    sent: list[SentRequest]
    sessions: int
    wall_s: float
    engine_itl_buckets: dict[float, float]
    """Per upper bound, the ITL histogram's cumulative count gained over the run, summed over engines."""
    engine_itl_sum_s: float
    non_engine_cpu_s: dict[str, float]
    """Process name -> CPU seconds over the run."""
    outside_cpu_s: float = 0.0
    """CPU seconds the host spent on work outside the benchmark over the run (``procs.outside_cpu_s``)."""


def _ms(seconds: Sequence[float], q: float) -> float:
    return round(percentile(seconds, q) * 1000, 1)


def _cached_tokens(usage: dict[str, Any]) -> int:
    """The engine-confirmed cached prompt tokens of one answer's ``usage`` (0 when it reports none)."""
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def summarize(runs: Sequence[RunRecord]) -> dict[str, Any]:
    """One arm's figures over its runs, requests pooled (percentiles of the union, not means of
    per-run percentiles)."""
    sent = [s for r in runs for s in r.sent]
    ok = [s for s in sent if s.result.ok]
    usage = [s.result.usage or {} for s in ok]
    prompt = sum(u.get("prompt_tokens") or 0 for u in usage)
    cached = sum(_cached_tokens(u) for u in usage)
    failed = {(r.round, s.session_id) for r in runs for s in r.sent if not s.result.ok}
    completed = sum(r.sessions for r in runs) - len(failed)
    wall = sum(r.wall_s for r in runs)
    itl = [gap for s in ok for gap in s.result.itl_s]
    buckets: dict[float, float] = {}
    for r in runs:
        for b, c in r.engine_itl_buckets.items():
            buckets[b] = buckets.get(b, 0.0) + c
    engine_count = buckets.get(float("inf"), 0.0)
    engine_sum = sum(r.engine_itl_sum_s for r in runs)
    cpu: dict[str, float] = {}
    for r in runs:
        for name, s in r.non_engine_cpu_s.items():
            cpu[name] = round(cpu.get(name, 0.0) + s, 2)
    engine_p50 = histogram_quantile(buckets, 0.5) * 1000
    client_p50 = _ms(itl, 0.5)
    return {
        "runs": len(runs),
        "requests": len(sent),
        "errors": len(sent) - len(ok),
        "sessions_completed": completed,
        "wall_s": round(wall, 1),
        "sessions_per_min": round(completed / wall * 60, 2) if wall > 0 else 0.0,
        "hit": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_p50_ms": _ms([s.result.ttft_s for s in ok], 0.5),
        "ttft_p99_ms": _ms([s.result.ttft_s for s in ok], 0.99),
        "e2e_p50_ms": _ms([s.result.e2e_s for s in ok], 0.5),
        "client_itl_p50_ms": client_p50,
        "client_itl_p99_ms": _ms(itl, 0.99),
        "engine_itl_p50_ms": round(engine_p50, 1),
        "engine_itl_mean_ms": round(engine_sum / engine_count * 1000, 1) if engine_count else float("nan"),
        "path_itl_p50_ms": round(client_p50 - engine_p50, 1),
        "non_engine_cpu_s": round(sum(cpu.values()), 2),
        "non_engine_cpu_by_process": cpu,
        "outside_cpu_s": round(sum(r.outside_cpu_s for r in runs), 2),
        "per_run_wall_s": [round(r.wall_s, 1) for r in runs],
    }


def requests_of(run: RunRecord) -> list[dict[str, Any]]:
    """Every request of one run as the client saw it, in the order sent: which turn of which session,
    when, TTFT, E2E, prompt and cached tokens. What tells a TTFT tail's requests apart (first turns of a
    repository's sessions, or warm turns queued behind them)."""
    rows = []
    for s in sorted(run.sent, key=lambda s: s.sent_s):
        usage = s.result.usage or {}
        rows.append(
            {
                "session": s.session_id,
                "turn": s.turn,
                "sent_s": round(s.sent_s, 3),
                "ok": s.result.ok,
                "ttft_ms": round(s.result.ttft_s * 1000, 1),
                "e2e_ms": round(s.result.e2e_s * 1000, 1),
                "prompt_tokens": usage.get("prompt_tokens") or s.result.prompt_tokens,
                "cached_tokens": _cached_tokens(usage),
            }
        )
    return rows


def targets(arms: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Issue 37's acceptance, each with its value, its bound and whether it held (None: an arm missing)."""
    t, v, tier = arms.get("tandem"), arms.get(BASELINE), arms.get("tandem_tier")

    def check(value: float | None, bound: float | None, held: bool | None) -> dict[str, Any]:
        return {"value": value, "bound": bound, "held": held}

    out: dict[str, dict[str, Any]] = {}
    if t is not None and v is not None:
        pairs = [
            ("sessions_per_min >= 1.10 x vllm-router", "sessions_per_min", 1.10, 0.0, True),
            ("client_itl_p50 <= 1.05 x vllm-router", "client_itl_p50_ms", 1.05, 0.0, False),
            ("ttft_p99 <= 0.8 x vllm-router", "ttft_p99_ms", 0.8, 0.0, False),
            ("hit >= vllm-router + 0.03", "hit", 1.0, 0.03, True),
        ]
        for name, key, factor, plus, at_least in pairs:
            bound = round(v[key] * factor + plus, 4)
            out[name] = check(t[key], bound, t[key] >= bound if at_least else t[key] <= bound)
    if t is not None and tier is not None:
        bound = round(tier["sessions_per_min"] * TIER_TOLERANCE, 3)
        name = "defaults arm >= tier arm (sessions_per_min)"
        out[name] = check(t["sessions_per_min"], bound, t["sessions_per_min"] >= bound)
    return out


def result_line(result: dict[str, Any]) -> str:
    arms, held = result["arms"], result["targets"]
    figures = " ".join(
        f"{arm}:spm={a['sessions_per_min']},hit={a['hit']},ttft99={a['ttft_p99_ms']},itl50={a['client_itl_p50_ms']}"
        for arm, a in arms.items()
    )
    n_held = sum(1 for t in held.values() if t["held"])
    missed = [name for name, t in held.items() if t["held"] is False]
    return f"RESULT fleet nodes={result['config']['nodes']} targets_held={n_held}/{len(held)} {figures}" + (
        f" missed={';'.join(missed)}" if missed else ""
    )


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
def run_fleet_bench(out: Path, cfg: FleetBenchConfig | None = None) -> dict[str, Any]:
    cfg = cfg or FleetBenchConfig()
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = _Tokens(cfg.model)
    nonce = uuid.uuid4().hex[:6]
    runs: list[RunRecord] = []
    commands: dict[str, list[str]] = {}
    load, probe = {"before": os.getloadavg()}, host_probe()
    _log(f"host: {probe}")
    for rnd in range(cfg.rounds):
        salt = f"fleet-{nonce}-r{rnd}"
        scripts = build_sessions(cfg.workload, salt, tokens.text, lambda m: len(tokens.prompt(m)))
        scripts = [
            dataclasses.replace(s, start_s=0.0, think_s=[min(t, cfg.max_think_s) for t in s.think_s]) for s in scripts
        ]
        order = cfg.arms if rnd % 2 == 0 else tuple(reversed(cfg.arms))
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
    arms = {arm: summarize([r for r in runs if r.arm == arm]) for arm in cfg.arms}
    result = {
        "config": {**dataclasses.asdict(cfg), "workdir": str(cfg.workdir)},
        "host": {"cores": len(os.sched_getaffinity(0)), "loadavg": load, **probe},
        "engine_commands": commands,
        "arms": arms,
        "per_run": {f"r{r.round}-{r.arm}": summarize([r]) for r in runs},
        "requests": {f"r{r.round}-{r.arm}": requests_of(r) for r in runs},
        "targets": targets(arms),
    }
    out.write_text(json.dumps(result, indent=2, default=str))
    with contextlib.suppress(FileNotFoundError):
        out.with_suffix(".partial.json").unlink()
    plot(arms, out.with_suffix(".png"))
    return result


def plot(arms: dict[str, dict[str, Any]], png: Path) -> None:
    names = list(arms)
    panels = [
        ("sessions per minute", ["sessions_per_min"]),
        ("engine-confirmed hit rate", ["hit"]),
        ("TTFT p50 / p99 (ms)", ["ttft_p50_ms", "ttft_p99_ms"]),
        ("ITL p50: client / engine (ms)", ["client_itl_p50_ms", "engine_itl_p50_ms"]),
        ("E2E p50 (ms)", ["e2e_p50_ms"]),
        ("non-engine CPU (s)", ["non_engine_cpu_s"]),
    ]
    fig, axes = subplots(2, 3, (15, 8))
    for ax, (title, keys) in zip(axes.flat, panels, strict=True):
        labels = [n.replace("vllm_router_", "vllm-router\n") for n in names]
        grouped_bars(ax, {key: [arms[n][key] for n in names] for key in keys}, labels)
        ax.set_title(title)
    fig.suptitle("tandem bench fleet: agent sessions on colocated nodes, Tandem vs vllm-router")
    save(fig, png)


__all__ = [
    "ARMS",
    "FleetBenchConfig",
    "RunRecord",
    "diff_buckets",
    "histogram_quantile",
    "parse_histogram",
    "plain_env",
    "result_line",
    "run_fleet_bench",
    "summarize",
    "targets",
]
