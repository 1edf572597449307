"""``tandem bench sim``: the same trace on the real cluster and in the SIMULATOR, per configuration, and
how far apart they land, metric by metric.

One run (one process; fresh engines for every configuration, so no cache survives from one to the next):

1. A small synthetic agentic trace (``traces.synth``) with a seed of its own per run, so that no engine
   cache from an earlier run can hold its prefixes.
2. For each configuration (``ARMS``: 1P+1D behind the router, two colocated nodes behind the router),
   started with ``infra.launcher.Cluster``:
   - the nodes as the router's ``/cluster`` lists them (role, URL, KV blocks, block size);
   - a profile measured on this very cluster (``profiling.measure`` and ``fit``), straight to each
     engine (a router would spread a batch of streams over nodes), one engine at a time with the
     others idle, one step model per node kind from its nodes' points; then how much slower a step
     runs while another engine of the host computes (``profiling.measure.neighbour_slowdown``: alone
     and beside busy neighbours; recorded, see ``profile_arm``). Measuring every engine at once
     instead, as this benchmark once did, folded a neighbour of random busyness into every
     point (one decode point 66 ms, its neighbour 150 ms). Then what the router adds (16-token prompts
     through it and straight to the engine, interleaved, so that prefill noise does not swamp it),
     added to every kind's ``request_overhead_s``; for P/D the handover: a P/D request's first token less the same
     prompt's first token straight from the prefill engine (pairs in turn, at 16 tokens and at the
     sweep's prefill lengths), less the router and the decode node's step for the prompt's last
     token, fitted against prompt length: the prefill kind's transfer coefficients (the router's
     pairs are layer-wise, so the pull overlaps the prefill and its own time is no handover);
   - the trace replayed closed loop through the router (``replay.runner``), the cores that processes
     outside this benchmark keep busy sampled every second (a shared host), then the cluster stopped.
3. The simulator (``simulator.fleet``) runs the same trace, closed loop, on the same nodes (``sim_specs``:
   role, KV blocks and block size as the engines reported them, each role's token budget per step,
   all on one host; the profile's ``shared_slowdown`` is left at 1: the neighbour probe's figures are
   recorded, and on this host they stay within its step noise),
   with the configuration's measured profile, the router's real ``cache_aware`` policy and the nodes'
   heartbeat period as its load staleness; ``simulator.report.summarize`` puts it in the replay's terms.
4. The comparison below: per configuration, the relative error of the simulated TTFT p50 and p90, ITL
   p50 and throughput against the real replay's, and the absolute error of the hit rate;
   ``plan_matches_real`` is 1 when the simulator ranks the configurations as they measured (by TTFT
   p90, the planner's deciding figure). The RESULT line reports, per metric, the worse of the
   configurations. Beside them, per configuration, how many requests the simulated router sent where
   the real one did (``routes_agree``: the real routes from the cluster's lake, ``real_routes``): the
   figure that explains a TTFT miss, since an early timing difference moves later decisions.

Written: ``--out`` JSON (every figure per configuration: real, simulated, errors, the profile and the
measurements it came from, the nodes, the outside load per phase and per second), a PNG beside it
(real and simulated TTFT and ITL distributions per configuration, and the outside load), and a folder
beside it with the trace, each replay's per-request results and each simulated request's times, so
that ``--from-json`` can simulate a recorded run again without engines.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.sim_compare import (
    Errors,
    errors,
    plan_matches_real,
    plot,
    real_routes,
    render,
    result_line,
    route_name,
    routes_agree,
)
from bench.sim_profile import CpuMeter, profile_arm
from contracts.config import redis_url as configured_redis_url
from contracts.errors import ConfigError
from contracts.registry import Role
from decode_nodes import engine_args as decode_engine_args
from infra.launcher import Cluster, ClusterSpec
from node_agent.settings import NodeSettings
from prefill_nodes import engine_args as prefill_engine_args
from profiling.measure import Sweep
from replay import Mode, PlannedRequest, ReplaySettings, Result, plan, run, summarize, to_table, write_results
from replay.results import Summary
from router.policies import CacheAware
from simulator.fleet import SIMULATED, FleetSim, NodeSpec
from simulator.report import SimSummary
from simulator.report import summarize as sim_summarize
from simulator.step_model import Profile
from traces.schema import Trace, read_trace, write_trace
from traces.synth import AgenticSpec, synth_agentic

# --- the comparison ---------------------------------------------------------------------------------


# --- configurations and their simulated twins -------------------------------------------------------
@dataclass(frozen=True)
class Arm:
    name: str
    prefill: int
    decode: int
    both: int


ARMS = (Arm("pd", 1, 1, 0), Arm("colocated", 0, 0, 2))
"""1P+1D and two colocated nodes, each behind one router (the acceptance's two configurations)."""


@dataclass(frozen=True)
class LiveNodeView:
    """A node as the router's ``/cluster`` shows it: what the simulator needs to copy it."""

    node_id: str
    role: Role
    url: str
    num_kv_blocks: int
    block_size: int


def _flag(args: list[str], name: str) -> int:
    return int(args[args.index(name) + 1])


# A colocated node passes no --max-num-batched-tokens: vLLM's default for its OpenAI server on a CPU
# build (vllm/engine/arg_utils.py, the CPU branch of the usage-context defaults) applies.
VLLM_CPU_SERVER_BATCHED_TOKENS = 2048


def batched_tokens(role: Role, max_model_len: int) -> int:
    """The token budget per step each role's engine runs with (the node's own engine arguments)."""
    if role is Role.PREFILL:
        return _flag(prefill_engine_args(max_model_len), "--max-num-batched-tokens")
    if role is Role.DECODE:
        return _flag(decode_engine_args(max_model_len), "--max-num-batched-tokens")
    return VLLM_CPU_SERVER_BATCHED_TOKENS


THIS_HOST = "bench-host"
"""The one host of a benchmark's cluster: its simulated twin's nodes share it (``NodeSpec.host``)."""


def sim_specs(nodes: Sequence[LiveNodeView], max_model_len: int) -> list[NodeSpec]:
    """The simulated fleet of a real one: same roles in the same order (ties in routing go by node id,
    which sorts the same way), KV blocks and block size as each engine reported them, all on one host."""
    if not nodes:
        raise ConfigError("the router lists no node")
    out = []
    for n in nodes:
        if n.num_kv_blocks < 2 or n.block_size <= 0:
            raise ConfigError(f"node {n.node_id} has not reported its KV cache ({n.num_kv_blocks} blocks)")
        out.append(
            NodeSpec(n.role, n.num_kv_blocks, n.block_size, batched_tokens(n.role, max_model_len), host=THIS_HOST)
        )
    return out


def simulate(
    trace: Trace, nodes: Sequence[LiveNodeView], profile: Profile, *, max_model_len: int, heartbeat_s: float
) -> tuple[FleetSim, SimSummary, list[dict[str, Any]]]:
    """SIMULATED: the trace closed loop on the real fleet's twin; its summary and per-request times."""
    sim = FleetSim(
        sim_specs(nodes, max_model_len), lambda lookup: CacheAware(lookup), step=profile, heartbeat_s=heartbeat_s
    )
    reqs = sim.run(trace, closed_loop=True)
    rows = []
    for r in reqs:
        times = sim.token_times(r)
        rows.append(
            {
                "request_id": r.request_id,
                "arrival_s": r.arrival_s,
                "ttft_s": (r.first_token_s or r.arrival_s) - r.arrival_s,
                "itl_s": np.diff(times).tolist(),
                "cached_tokens": r.engine_cached_tokens,
                "prompt_tokens": r.prompt_tokens,
                "mode": "disaggregated" if r.decision and r.decision.prefill else "local",
                "decode_node": r.decision.decode.node_id if r.decision else None,
                "route": route_name(
                    r.decision.prefill.node_id if r.decision.prefill else None, r.decision.decode.node_id
                )
                if r.decision
                else None,
                "reason": r.decision.code.value if r.decision else None,
            }
        )
    return sim, sim_summarize(sim, reqs), rows


# --- where each request went, real against simulated -------------------------------------------------


# --- settings ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimBenchConfig:
    """Everything one ``tandem bench sim`` run needs (one object per process)."""

    sessions: int = 45
    """Agent sessions in the trace (at 30, ~110 requests, a configuration's TTFT
    p90 rested on its 11 slowest and moved 20% between runs of the same code)."""
    seed: int | None = None
    """Trace seed; None: one from the clock, so no engine cache of an earlier run holds its prefixes."""
    session_rate: float = 0.5
    """Session arrivals per second."""
    dtype: str = "float32"
    """Engine dtype (float32 prefills about twice as fast as bfloat16 on this AVX2 host)."""
    block_size: int = 32
    """KV block size of every node (the CPU attention backend wants a multiple of 32)."""
    kv_cache_gib: int = 1
    """KV cache per node, GiB."""
    router_port: int = 19700
    node_base_port: int = 19710
    redis_url: str = field(default_factory=lambda: configured_redis_url(db=8))
    """The registry of the benchmark's clusters: $TANDEM_REDIS_URL's server, database 8."""
    workdir: Path = Path(".tandem/bench-sim")
    sweep: Sweep = Sweep(
        prefill_tokens=(64, 256, 768, 1536),
        repeats=3,
        prefix_contexts=(512, 1536),
        prefix_new=(32, 256),
        batches=(1, 4, 8, 16),
        contexts=(256, 1024, 2304),
        mixed_prefill=(256, 1024),
        unshared=((4, 1024), (8, 384), (8, 1024), (12, 1024)),
        decode_tokens=32,
    )
    """Every node's profiling sweep; its prefill lengths also time the P/D pulls. Decode batches and
    contexts reach what a busy node of the replay runs (10-16 streams at 1-2.4k tokens), and each
    batch has prompts of 256 and 1,024 tokens computed beside it (mixed steps, what a colocated node
    mostly runs), so the step model is fitted where the replay runs, not extrapolated; batches of
    distinct prompts tell the cache reads (once per shared block) from the per-stream arithmetic, up to
    the 12k distinct KV tokens a busy node of the replay holds (with 4k at most, the fitted cost of a
    KV token, extrapolated, put the 1P+1D replay's simulated ITL p50 at 215 ms against a real 178)."""
    arms: tuple[Arm, ...] = ARMS

    def trace_spec(self, seed: int) -> AgenticSpec:
        # Sized for this 2-core host: prompts of 0.5-2.4k tokens (a float32 engine on one core prefills
        # ~400 tokens/s), short answers, ~165 requests, 4-6 min of replay per configuration.
        return AgenticSpec(
            sessions=self.sessions,
            seed=seed,
            session_rate=self.session_rate,
            system_prompts=2,
            system_tokens=384,
            repositories=4,
            repo_tokens=(128, 1024),
            user_tokens=(32, 128),
            turns_mean=4.0,
            output_tokens=(16, 64),
            tool_tokens_median=96.0,
            gap_s_median=1.0,
            max_input_tokens=2400,
        )


Say = Callable[[str], None]


# --- the real half ----------------------------------------------------------------------------------


async def _replay_watched(
    planned: list[PlannedRequest], settings: ReplaySettings, on_result: Callable[[object], None]
) -> tuple[list[Result], list[float]]:
    """The replay, with the cores busy outside this benchmark sampled every second while it runs (a
    burst of another job shows where it fell)."""
    meter, samples = CpuMeter(), []

    async def sample() -> None:
        while True:
            await asyncio.sleep(1.0)
            samples.append(meter.lap()["cores_busy_elsewhere"])

    sampler = asyncio.create_task(sample())
    try:
        return await run(planned, settings, on_result=on_result), samples
    finally:
        sampler.cancel()


def _nodes(url: str) -> list[LiveNodeView]:
    data = httpx.get(f"{url}/cluster", timeout=10).json()["nodes"]
    return [
        LiveNodeView(n["node_id"], Role(n["role"]), n["url"], int(n["num_kv_blocks"]), int(n["block_size"]))
        for n in sorted(data, key=lambda n: n["node_id"])
    ]


def run_arm(arm: Arm, cfg: SimBenchConfig, trace: Trace, seed: int, files: Path, say: Say) -> dict[str, Any]:
    """Start the configuration, profile it, replay the trace on it, stop it."""
    spec = ClusterSpec(
        prefill=arm.prefill,
        decode=arm.decode,
        both=arm.both,
        dtype=cfg.dtype,
        kv_cache_gib=cfg.kv_cache_gib,
        block_size=cfg.block_size,
        router_port=cfg.router_port,
        node_base_port=cfg.node_base_port,
        redis_url=cfg.redis_url,
        workdir=cfg.workdir / arm.name,
        routers=1,
    )
    cluster = Cluster(spec)
    started = time.monotonic()
    cluster.start()
    try:
        last = [0.0]

        def starting(m: str) -> None:
            if time.monotonic() - last[0] > 10:
                last[0] = time.monotonic()
                say(f"{arm.name}: starting ({time.monotonic() - started:.0f} s) {m}")

        cluster.wait_ready(on_progress=starting)
        say(f"{arm.name}: ready in {time.monotonic() - started:.0f} s")
        card = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"][0]
        model, window = card["id"], int(card["max_model_len"])
        nodes = _nodes(cluster.url)
        meter = CpuMeter()
        profile, raw = asyncio.run(profile_arm(arm, nodes, cluster.url, model, cfg, seed, say))
        load = {"profile": meter.lap()}
        planned, scaling = plan(trace, block_size=nodes[0].block_size, context_window=window)
        say(f"{arm.name}: replaying {len(planned)} requests closed loop ({scaling.describe()})")
        settings = ReplaySettings(
            url=cluster.url, model=model, mode=Mode.CLOSED, session_prefix=f"bench-sim-{seed}-{arm.name}-"
        )
        done = [0]

        def progress(_: object) -> None:
            done[0] += 1
            if done[0] % 10 == 0 or done[0] == len(planned):
                say(f"{arm.name}: {done[0]}/{len(planned)} answered")

        t0 = time.monotonic()
        results, elsewhere = asyncio.run(_replay_watched(planned, settings, progress))
        load["replay"] = meter.lap()
        load["replay_elsewhere_per_s"] = elsewhere
        say(
            f"{arm.name}: replay took {time.monotonic() - t0:.0f} s; cores busy outside this benchmark: "
            f"{load['profile']['cores_busy_elsewhere']} while profiling, {load['replay']['cores_busy_elsewhere']} "
            "while replaying"
        )
    finally:
        cluster.stop()
    table = to_table(results)
    write_results(table, files / f"{arm.name}-replay.parquet", {"trace": trace.meta.source, "url": cluster.url})
    routes = real_routes(cluster.lake, settings.session_prefix or "", nodes, table.to_pylist())
    real = summarize(table)
    if real.ok < real.requests:
        failed = [r["error"] for r in table.to_pylist() if r["status"] != "ok"]
        say(f"{arm.name}: {real.requests - real.ok} requests failed, e.g. {failed[0]}")
    return {
        "nodes": [{**asdict(n), "role": n.role.value} for n in nodes],
        "max_model_len": window,
        "profile": json.loads(profile.to_json()),
        "real": asdict(real),
        "real_requests": [
            {k: r[k] for k in ("request_id", "ttft_s", "itl_s", "cached_tokens", "prompt_tokens", "status")}
            for r in table.to_pylist()
        ],
        "measurements": raw,
        "host_load": load,
        "real_routes": routes,
    }


# --- one run ----------------------------------------------------------------------------------------
def _profile_of(doc: Mapping[str, Any], path: Path) -> Profile:
    path.write_text(json.dumps(doc))
    return Profile.load(path)


def compare(arms: dict[str, dict[str, Any]], trace: Trace, files: Path, heartbeat_s: float) -> dict[str, Any]:
    """The simulated half for recorded real halves; fills in ``sim``, ``errors`` and the RESULT line."""
    for name, a in arms.items():
        nodes = [LiveNodeView(**{**n, "role": Role(n["role"])}) for n in a["nodes"]]
        profile = _profile_of(a["profile"], files / f"{name}-profile.json")
        _, s, rows = simulate(trace, nodes, profile, max_model_len=a["max_model_len"], heartbeat_s=heartbeat_s)
        a["sim"] = asdict(s)
        a["sim_requests"] = rows
        a["errors"] = asdict(errors(a["real"], a["sim"]))
        if "real_routes" in a:
            a["routes_agree"] = routes_agree(a["real_routes"], rows)
    per = {name: Errors(**a["errors"]) for name, a in arms.items()}
    matches = plan_matches_real({n: a["real"] for n, a in arms.items()}, {n: a["sim"] for n, a in arms.items()})
    return {"plan_matches_real": matches, "result": result_line(per, matches)}


def write(out: Path, doc: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    plot(doc["configs"], out.with_suffix(".png"))


def files_dir(out: Path) -> Path:
    return out.with_suffix("")


def run_sim_bench(out: Path, cfg: SimBenchConfig, say: Say) -> dict[str, Any]:
    seed = cfg.seed if cfg.seed is not None else int(time.time()) % 1_000_000
    files = files_dir(out)
    files.mkdir(parents=True, exist_ok=True)
    trace = synth_agentic(cfg.trace_spec(seed))
    write_trace(trace, files / "trace.parquet")
    say(f"trace: {len(trace)} requests in {cfg.sessions} sessions, seed {seed}")
    arms = {}
    for arm in cfg.arms:
        arms[arm.name] = run_arm(arm, cfg, trace, seed, files, say)
    heartbeat_s = NodeSettings().heartbeat_s
    summary = compare(arms, trace, files, heartbeat_s)
    doc = {
        "benchmark": "sim",
        "label": f"real replays against {SIMULATED} runs of the same trace",
        "time": time.time(),
        "seed": seed,
        "trace": {"file": str(files / "trace.parquet"), "requests": len(trace), "spec": asdict(cfg.trace_spec(seed))},
        "sim_heartbeat_s": heartbeat_s,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "configs": arms,
        **summary,
    }
    write(out, doc)
    say(render(arms))
    say(f"wrote {out}, {out.with_suffix('.png')} and {files}/")
    return doc


def resimulate(recorded: Path, out: Path, say: Say) -> dict[str, Any]:
    """The simulated half again for a recorded run (its trace, nodes, profiles and real figures): for work
    on the simulator without engines. The real figures are the recorded ones, not measured again."""
    doc = json.loads(recorded.read_text())
    trace = read_trace(Path(doc["trace"]["file"]))
    files = files_dir(out)
    files.mkdir(parents=True, exist_ok=True)
    doc.update(compare(doc["configs"], trace, files, doc["sim_heartbeat_s"]))
    doc["resimulated_from"] = str(recorded)
    write(out, doc)
    say(render(doc["configs"]))
    return doc


__all__ = [
    "ARMS",
    "Arm",
    "Errors",
    "LiveNodeView",
    "SimBenchConfig",
    "Summary",
    "compare",
    "errors",
    "plan_matches_real",
    "real_routes",
    "result_line",
    "resimulate",
    "route_name",
    "routes_agree",
    "run_sim_bench",
    "sim_specs",
    "simulate",
]
