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
import contextlib
import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from contracts.config import redis_url as configured_redis_url
from contracts.errors import ConfigError
from contracts.registry import Role
from contracts.secret import engine_auth_headers
from decode_nodes import engine_args as decode_engine_args
from infra.launcher import Cluster, ClusterSpec
from node_agent.model import default_model_dir
from node_agent.settings import NodeSettings
from prefill_nodes import engine_args as prefill_engine_args
from profiling.fit import fit_step_model, nnls
from profiling.measure import Sweep, first_tokens, measure, neighbour_slowdown
from replay import Mode, PlannedRequest, ReplaySettings, Result, plan, run, summarize, to_table, write_results
from replay.results import Summary
from router.policies import CacheAware
from simulator.fleet import SIMULATED, FleetSim, NodeSpec
from simulator.report import SimSummary
from simulator.report import summarize as sim_summarize
from simulator.step_model import Profile, StepModel
from traces.schema import Trace, read_trace, write_trace
from traces.synth import AgenticSpec, synth_agentic

RELATIVE = ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "output_tok_s")


# --- the comparison ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Errors:
    ttft_p50: float
    ttft_p90: float
    itl_p50: float
    tput: float
    hit: float
    """Absolute (hit rates are shares already)."""


def errors(real: Mapping[str, float], sim: Mapping[str, float]) -> Errors:
    """``real`` and ``sim``: ``replay.results.Summary`` / ``simulator.report.SimSummary`` fields."""
    rel = [abs(sim[k] - real[k]) / real[k] if real[k] else float("inf") for k in RELATIVE]
    return Errors(*rel, hit=abs(sim["observed_hit"] - real["observed_hit"]))


def plan_matches_real(real: Mapping[str, Mapping[str, float]], sim: Mapping[str, Mapping[str, float]]) -> bool:
    """Whether the simulator orders the configurations by TTFT p90 as the real runs did."""

    def order(runs: Mapping[str, Mapping[str, float]]) -> list[str]:
        return sorted(runs, key=lambda name: runs[name]["ttft_p90_s"])

    return order(real) == order(sim)


def result_line(per_config: Mapping[str, Errors], matches: bool) -> str:
    worst = {f: max(getattr(e, f) for e in per_config.values()) for f in Errors.__dataclass_fields__}
    return (
        f"RESULT ttft_p50_err={worst['ttft_p50']:.3f} ttft_p90_err={worst['ttft_p90']:.3f} "
        f"itl_p50_err={worst['itl_p50']:.3f} tput_err={worst['tput']:.3f} hit_err={worst['hit']:.3f} "
        f"plan_matches_real={int(matches)}"
    )


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
def route_name(prefill: str | None, decode: str) -> str:
    """A request's route: ``decode`` alone (it prefilled itself) or ``prefill->decode``."""
    return f"{prefill}->{decode}" if prefill else decode


def real_routes(
    lake: Path, session_prefix: str, nodes: Sequence[LiveNodeView], replay: Sequence[Mapping[str, Any]]
) -> dict[str, str]:
    """Where the real router sent each replayed request, from the cluster's lake (its ``requests``
    rows: ``prefill_node``, ``decode_node``), by the replay's request id, in the simulator's node names
    (``sim_specs`` keeps the nodes' order; node i is ``{role}-{i}``). The lake knows the router's request
    ids, not the trace's: a session's rows (``session_prefix`` + the trace's session) are matched to the
    replay's requests of that session in the order they were sent (closed loop: one at a time). A
    session whose rows the lake does not hold in full is left out."""
    from telemetry.query import query

    names = {n.node_id: f"{n.role.value}-{i}" for i, n in enumerate(nodes)}
    rows = query(lake, "SELECT session_id, t_arrival, prefill_node, decode_node FROM requests").to_pylist()
    lake_rows: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: r["t_arrival"]):
        sid = r["session_id"] or ""
        if sid.startswith(session_prefix):
            lake_rows.setdefault(sid.removeprefix(session_prefix), []).append(r)
    sent: dict[str, list[str]] = {}
    for r in sorted(replay, key=lambda r: r["sent_s"] if r["sent_s"] is not None else float("inf")):
        if r["session_id"] is not None:
            sent.setdefault(r["session_id"], []).append(r["request_id"])
    out = {}
    for sid, ids in sent.items():
        got = lake_rows.get(sid, [])
        if len(got) != len(ids):
            continue
        for rid, r in zip(ids, got, strict=True):
            prefill = r["prefill_node"] and names.get(r["prefill_node"], r["prefill_node"])
            out[rid] = route_name(prefill, names.get(r["decode_node"], r["decode_node"]))
    return out


def routes_agree(real: Mapping[str, str], sim_rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How many requests the simulated router sent where the real one did (of those the lake matched):
    a timing difference early in a run can move later decisions, and with them TTFT."""
    matched = [r for r in sim_rows if r["request_id"] in real]
    agree = sum(real[r["request_id"]] == r["route"] for r in matched)
    return {
        "requests": len(sim_rows),
        "matched": len(matched),
        "agree": agree,
        "share": round(agree / len(matched), 3) if matched else None,
    }


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
class CpuMeter:
    """How much CPU processes outside this benchmark took during a phase (another job on a shared host
    slows the engines; a profile measured under one load and a replay run under another disagree, and
    the record should show it). Cores busy: all of the machine's busy time less this process tree's."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        t = psutil.cpu_times()
        busy = t.user + t.system + t.nice + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        ours = 0.0
        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                c = p.cpu_times()
                ours += c.user + c.system
        return time.monotonic(), busy, ours

    def lap(self) -> dict[str, float]:
        """Since the last lap: seconds, cores busy in all, cores busy outside this benchmark."""
        (t0, b0, o0), (t1, b1, o1) = self._start, self._read()
        self._start = (t1, b1, o1)
        span = max(t1 - t0, 1e-9)
        return {
            "seconds": round(t1 - t0, 1),
            "cores_busy": round((b1 - b0) / span, 2),
            "cores_busy_elsewhere": round(max(0.0, (b1 - b0) - (o1 - o0)) / span, 2),
        }


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


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return int(2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * width)


def _nodes(url: str) -> list[LiveNodeView]:
    data = httpx.get(f"{url}/cluster", timeout=10).json()["nodes"]
    return [
        LiveNodeView(n["node_id"], Role(n["role"]), n["url"], int(n["num_kv_blocks"]), int(n["block_size"]))
        for n in sorted(data, key=lambda n: n["node_id"])
    ]


def _metric(text: str, name: str) -> float:
    """Sum of a metric's samples in a Prometheus exposition (every engine label)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


PULL_SECONDS, PULL_COUNT = "tandem_kv_transfer_seconds_sum", "tandem_kv_transfer_seconds_count"


async def _pulls(client: httpx.AsyncClient, decode_url: str, count_before: float, n: int) -> tuple[float, float]:
    """(pull seconds, pulls) on the decode engine once ``n`` more pulls than ``count_before`` show: its
    metrics come from the engine's stats stream, a little after the answer (no notification exists)."""
    deadline = time.monotonic() + 30
    while True:
        text = (await client.get(f"{decode_url}/metrics")).text
        count = _metric(text, PULL_COUNT)
        if count >= count_before + n or time.monotonic() > deadline:
            return _metric(text, PULL_SECONDS), count
        await asyncio.sleep(0.2)


TINY_TOKENS = 16
"""Prompt of the paired requests that time the router and the handover: so short that its prefill
varies little between two requests."""


async def profile_arm(
    arm: Arm, nodes: Sequence[LiveNodeView], router_url: str, model: str, cfg: SimBenchConfig, seed: int, say: Say
) -> tuple[Profile, dict[str, Any]]:
    """The configuration's profile, measured on it: a step model per node kind (each engine alone), how
    much a busy neighbour on the host slows a step, the router's overhead, and for P/D the handover
    against prompt tokens."""
    auth = engine_auth_headers(loopback_only=True)
    base = StepModel(kv_bytes_per_token=kv_bytes_per_token(default_model_dir(), cfg.dtype))
    measured = []
    for k, n in enumerate(nodes):
        say(f"{arm.name}: profiling {n.node_id} (the other engines idle)")
        measured.append(
            await measure(
                n.url, model, cfg.sweep, seed=seed + k, headers=auth, progress=lambda m, n=n: say(f"  {n.node_id}: {m}")
            )
        )
    models: dict[Role, StepModel] = {}
    raw: dict[str, Any] = {}
    for role in dict.fromkeys(n.role for n in nodes):
        mine = [m for n, m in zip(nodes, measured, strict=True) if n.role is role]
        pre = [p for m in mine for p in m.prefill]
        dec = [d for m in mine for d in m.decode]
        mix = [x for m in mine for x in m.mixed]
        step, err = fit_step_model(
            pre, dec, mix, base=base, source=f"measured on the {arm.name} cluster's {role.value} nodes"
        )
        models[role] = step
        raw[role.value] = {
            "prefill": [asdict(p) for p in pre],
            "decode": [asdict(d) for d in dec],
            "mixed": [asdict(x) for x in mix],
            "fit_rel_rms": err,
        }
        say(
            f"{arm.name} {role.value}: base {step.base_s * 1e3:.1f} ms, "
            f"prefill {step.prefill_s_per_token * 1e3:.2f} ms/token"
            f" + {step.prefill_s_per_ctx_pair * 1e9:.2f}/{step.prefill_s_per_new_pair * 1e9:.2f} ns a cached/new pair,"
            f" decode {step.decode_s_per_seq * 1e3:.2f} ms/seq"
            f" + {step.decode_s_per_ctx_token * 1e9:.1f} ns/ctx token + {step.decode_s_per_kv_token * 1e9:.1f} ns/KV"
            f" token held, overhead {step.request_overhead_s * 1e3:.1f} ms;"
            f" fit relative RMS {err:.1%}"
        )
    rng = random.Random(seed + 100)
    vocab = cfg.sweep.vocab
    # the engine that serves a request the router sends whole: the decode node in a P/D cluster
    local = next(n for n in nodes if n.role is (Role.DECODE if arm.prefill else Role.BOTH))
    others = [n.url for n in nodes if n is not local]
    if others:
        say(f"{arm.name}: {local.node_id} alone and beside busy neighbours")
        slow = await neighbour_slowdown(
            local.url, others, model, seed=seed + 200, headers=auth, vocab=vocab, progress=lambda m: say(f"  {m}")
        )
        # Recorded, not applied: three runs on a 2-core host measured a decode step 1.11, 1.65 and 1.08x and
        # a prefill 0.94-1.04x slower beside a busy neighbour, within this host's step noise (one decode
        # batch swings 2x on its own), and the 1.31x of the second run, applied, put the 1P+1D replay's
        # simulated ITL p50 at 174 ms against a real 116 (153 ms with 1.0). The simulator's processor
        # sharing stays for hosts where a profile measures a real effect (``StepModel.shared_slowdown``).
        raw["neighbours"] = {**asdict(slow), "decode": slow.decode, "prefill": slow.prefill, "factor": slow.factor}
        say(
            f"{arm.name}: beside a busy neighbour a decode step took {slow.decode:.2f}x, a prefill "
            f"{slow.prefill:.2f}x (recorded, not applied)"
        )
    prefill = next((n for n in nodes if n.role is Role.PREFILL), None)
    pairs: dict[str, list[float]] = {"direct": [], "routed": [], "direct_prefill": [], "pd": []}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        say(f"{arm.name}: {TINY_TOKENS}-token prompts straight to the engines and through the router, interleaved")
        for _ in range(4 * cfg.sweep.repeats):
            legs = [("direct", local.url, auth), ("routed", router_url, {"x-tandem-route": "colocated"})]
            if prefill is not None:
                legs += [("direct_prefill", prefill.url, auth), ("pd", router_url, {"x-tandem-route": "disaggregated"})]
            for key, url, headers in legs:
                (point,) = await first_tokens(client, url, model, (TINY_TOKENS,), 1, rng, vocab, headers)
                pairs[key].append(point.seconds)
        # what the router adds, both ways: its work and its hop (the engines' own HTTP is in the fit)
        router_s = max(0.0, float(np.median(pairs["routed"]) - np.median(pairs["direct"])))
        raw["router"] = {"tiny_tokens": TINY_TOKENS, **pairs, "router_s": router_s}
        models = {r: replace(m, request_overhead_s=m.request_overhead_s + router_s) for r, m in models.items()}
        say(f"{arm.name}: the router adds {router_s * 1e3:.1f} ms a request")
        if prefill is not None:
            d, p = models[Role.DECODE], models[Role.PREFILL]
            # The handover: what a P/D request's first token takes beyond the same prompt's prefill sent
            # straight to the prefill engine, less the router and the decode node's step that computes
            # the prompt's last token. Timed in pairs (straight, then P/D, in turn, so that the host's
            # load drifts out of the difference), because the router's pairs are layer-wise: the decode
            # node pulls each layer while the prefill computes the next, so the pull's own time
            # (tandem_kv_transfer_seconds, kept in the record) spans the prefill and says nothing of
            # what the transfer adds after it. Taken for the transfer, it charged every simulated P/D
            # request its prefill twice (in one recorded run: P/D TTFT p90 1.04 off).
            pull_s0, pulls_n0 = await _pulls(client, local.url, 0, 0)
            extra: dict[int, list[float]] = {
                TINY_TOKENS: [q - s for q, s in zip(pairs["pd"], pairs["direct_prefill"], strict=True)]
            }
            pd_first: dict[int, float] = {}
            pd_route = {"x-tandem-route": "disaggregated"}
            for n in cfg.sweep.prefill_tokens:
                straight, paired = [], []
                for _ in range(cfg.sweep.repeats):
                    (q,) = await first_tokens(client, prefill.url, model, (n,), 1, rng, vocab, auth)
                    straight.append(q.seconds)
                    (q,) = await first_tokens(client, router_url, model, (n,), 1, rng, vocab, pd_route)
                    paired.append(q.seconds)
                extra[n] = [q - s for q, s in zip(paired, straight, strict=True)]
                pd_first[n] = float(np.median(paired))
            pull_s1, pulls_n1 = await _pulls(client, local.url, pulls_n0, len(pd_first) * cfg.sweep.repeats)
            handover = {
                n: max(0.0, float(np.median(v)) - router_s - d.step_s(1, 0, 0, n - 1, 0.5)) for n, v in extra.items()
            }
            ns = np.array(sorted(handover), dtype=float)
            fixed, per_token = nnls(np.column_stack([np.ones_like(ns), ns]), np.array([handover[int(n)] for n in ns]))
            bw = p.kv_bytes_per_token / per_token if per_token > 0 else 1e15
            models[Role.PREFILL] = replace(p, transfer_base_s=float(fixed), transfer_bytes_per_s=float(bw))
            predicted = {
                n: models[Role.PREFILL].request_overhead_s
                + models[Role.PREFILL].step_s(n, 0, 0, 0.0, n * n / 2)
                + models[Role.PREFILL].transfer_s(n)
                + d.step_s(1, 0, 0, n - 1, 0.5)
                for n in pd_first
            }
            raw["handover"] = {
                "pd_less_straight_s": extra,
                "handover_s": handover,
                "fixed_s": float(fixed),
                "s_per_token": float(per_token),
                "pull_mean_s_layerwise_spans_prefill": (pull_s1 - pull_s0) / max(pulls_n1 - pulls_n0, 1),
                "pd_first_token_s": pd_first,
                "pd_first_token_predicted_s": predicted,
            }
            say(f"{arm.name}: handover {fixed * 1e3:.1f} ms + {per_token * 1e6:.1f} us/token ({bw / 1e9:.2f} GB/s)")
    desc = f"measured on the {arm.name} cluster of tandem bench sim (its engines at once), {cfg.dtype}"
    return Profile(models=models, description=desc, measurements=raw), raw


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


def render(arms: Mapping[str, Mapping[str, Any]]) -> str:
    lines = []
    for name, a in arms.items():
        r, s, e = a["real"], a["sim"], a["errors"]
        lines.append(
            f"{name:>10} real      TTFT p50 {r['ttft_p50_s'] * 1e3:7.0f} ms p90 {r['ttft_p90_s'] * 1e3:7.0f} ms  "
            f"ITL p50 {r['itl_p50_s'] * 1e3:5.1f} ms  {r['output_tok_s']:6.1f} tok/s  hit {r['observed_hit']:.3f}"
            f"  ({r['ok']}/{r['requests']} ok)"
        )
        lines.append(
            f"{'':>10} {SIMULATED:<9} TTFT p50 {s['ttft_p50_s'] * 1e3:7.0f} ms p90 {s['ttft_p90_s'] * 1e3:7.0f} ms  "
            f"ITL p50 {s['itl_p50_s'] * 1e3:5.1f} ms  {s['output_tok_s']:6.1f} tok/s  hit {s['observed_hit']:.3f}"
        )
        lines.append(
            f"{'':>10} error     TTFT p50 {e['ttft_p50']:.3f}  p90 {e['ttft_p90']:.3f}  ITL p50 {e['itl_p50']:.3f}  "
            f"tput {e['tput']:.3f}  hit {e['hit']:.3f}"
        )
        agree = a.get("routes_agree")
        if agree and agree["matched"]:
            lines.append(
                f"{'':>10} routes    {agree['agree']}/{agree['matched']} requests routed as in the real run"
                f" ({agree['requests'] - agree['matched']} not matched in the lake)"
            )
    return "\n".join(lines)


def plot(arms: Mapping[str, Mapping[str, Any]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(arms), figsize=(6 * len(arms), 11), squeeze=False)
    for col, (name, a) in enumerate(arms.items()):
        real = [r for r in a["real_requests"] if r["status"] == "ok"]
        series = {
            "real": ([r["ttft_s"] for r in real], [g for r in real for g in r["itl_s"]]),
            f"{SIMULATED}": (
                [r["ttft_s"] for r in a["sim_requests"]],
                [g for r in a["sim_requests"] for g in r["itl_s"]],
            ),
        }
        for row, (metric, unit) in enumerate((("TTFT", "s"), ("ITL", "ms"))):
            ax = axes[row][col]
            for label, values in series.items():
                v = np.sort(np.asarray(values[row], dtype=float)) * (1e3 if unit == "ms" else 1.0)
                ax.plot(v, np.arange(1, len(v) + 1) / max(len(v), 1), label=label, ls="--" if label != "real" else "-")
            e = a["errors"]
            note = (
                f"p50 err {e['ttft_p50']:.2f}, p90 err {e['ttft_p90']:.2f}"
                if row == 0
                else f"p50 err {e['itl_p50']:.2f}"
            )
            ax.set_title(f"{name}: {metric} ({note})")
            ax.set_xlabel(f"{metric} ({unit})")
            ax.set_ylabel("share of requests" if row == 0 else "share of gaps")
            ax.grid(alpha=0.3)
            ax.legend()
        ax = axes[2][col]
        elsewhere = a.get("host_load", {}).get("replay_elsewhere_per_s", [])
        ax.plot(np.arange(1, len(elsewhere) + 1), elsewhere, color="gray")
        ax.set_title(f"{name}: cores busy outside the benchmark during the replay")
        ax.set_xlabel("replay time (s)")
        ax.set_ylabel("cores")
        ax.set_ylim(0, 2)
        ax.grid(alpha=0.3)
    fig.suptitle("tandem bench sim: real cluster against the SIMULATED one, same trace, measured profile")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


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
