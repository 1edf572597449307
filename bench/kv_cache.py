"""`tandem bench kv-cache`: what the host tier and session retention reuse on agent traffic whose shared
context does not fit one node's engine cache, against the fair baseline of giving vLLM that memory.

Workload: ``bench.agent_workload`` (sessions over shared repositories, growing turns, real SSE through
the router, ``x-session-id`` on every request), sized so that the run's shared context (system prompt
and repositories: ~6.7k tokens, 210 blocks) is larger than one node's engine cache in every arm (96
blocks alone, 164 with the bigger cache), with tool pauses (``think_s``) long enough for the other
sessions to push a paused session's blocks out of the engines. A repository's three sessions start one
after another, 5 s apart (``fan_out_gap_s``: parallel agents on one repository, as coding agents fan
out), so cache-aware routing, which weighs a node's queue against its cached prefix, often places them
on different nodes: each repository's context is then wanted on several, once in the host tier or
again in each engine. (5 s is about one prefill of the repository here: sessions started closer would
compute it in parallel before any cache could hold it, a loss no arm can avoid and the unlimited-cache
ceiling does not count.)

Four colocated nodes (``nodes``) share the host, as engines on a GPU host's GPUs do: with two, cache-
aware routing keeps most of a repository's sessions on one node, and the bigger cache ties the tier
(measured with 2 nodes, 2 repositories of 6 sessions: 0.904 against 0.903, both 0.98 of the ceiling).

Arms, each on ``nodes`` fresh colocated nodes behind one router (cache_aware), fresh content per arm (a
salt in the shared system prompt, so no arm warms another), in this order:

    engines        the engines alone: ``node_blocks`` KV blocks each
    tier           our tiers: the same engines + a host tier of ``tier_mib`` (shared by every node: a
                   block one node offloaded, another loads) + cross-node reuse (``--peer-kv``: a node
                   loads a prefix another's engine holds, ``router.planning.peer_fetch``), retention off
    bigger_cache   no tier; each engine given its share of the tier's memory as extra KV blocks
                   ("just give vLLM more memory", the baseline a user would try first)
    retention      our tiers + session retention (pins across the tool pause, ``router.planning.retention``)

The bench runs without auth, so every session is one tenant's: its pins may hold ``pin_share`` of the
tier (``TANDEM_TIER_TENANT_PIN_SHARE`` of the tier process, set explicitly here and recorded).

Per arm: the engine-confirmed hit rate (prompt_tokens_details.cached_tokens over prompt tokens: the
engine's own cache plus what it loaded from the tier or a peer), TTFT p50/p99, and ``ceiling``: what one
cache of unlimited size would reuse on the same request sequence (``router.kv_index.ideal``), computed
the same way for every arm (the ceiling is the largest).

TTFT by where a prompt's prefix came from: at the end of the tier arm, on the idle cluster,
``bench.kv_probe`` sends fresh prompts of the workload's longest shared prefix (system + repository) as a
miss on node A, a local hit on A and a remote hit on B (pinned with ``x-tandem-node``); its medians are
the RESULT line's ``local_hit_ttft_ms``, ``remote_hit_ttft_ms`` and ``miss_ttft_ms``. The same split of
the tier arms' own long prompts under load is kept in the JSON (``by_origin_under_load``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.agent_workload import AgentWorkloadConfig
from bench.kv_probe import probe_by_origin
from bench.routing import RoutingBenchConfig, _cluster, _cluster_view, _model, _Runner, _Tokens, _warm, console
from contracts.config import redis_url as configured_redis_url
from host_tier.settings import layout_from_model
from infra.launcher import ClusterSpec
from node_agent.dtype import resolve_dtype
from node_agent.model import resolve_model

ARMS = ("engines", "tier", "bigger_cache", "retention")
REPOS = 4
"""Repositories the sessions share: 6.4k tokens of repository context plus the system prompt over 12
sessions, three per repository started 5 s apart."""


def default_workload() -> AgentWorkloadConfig:
    return AgentWorkloadConfig(
        repos=REPOS,
        sessions_per_repo=3,
        turns_min=5,
        turns_max=8,
        system_tokens=300,
        repo_tokens=1600,
        tool_tokens=(60, 180),
        reply_tokens=(15, 35),
        context_budget=2900,
        session_gap_s=10.0,
        fan_out_gap_s=5.0,
        think_s=12.0,
    )


def smoke_workload() -> AgentWorkloadConfig:
    """A few minutes in all: every arm, the probe and the plot, on a workload too small to compare arms."""
    return replace(default_workload(), repos=2, sessions_per_repo=2, turns_min=3, turns_max=4, think_s=4.0)


@dataclass(frozen=True)
class KVCacheBenchConfig:
    workload: AgentWorkloadConfig = field(default_factory=default_workload)
    nodes: int = 4
    """Colocated nodes on this host, sharing its one tier. Four, as on a GPU host with an engine per GPU:
    a repository's parallel sessions then land on several nodes, so its context is wanted on several
    at once, which each engine's own cache must hold again and the host tier holds once."""
    node_blocks: int = 96
    """Engine KV blocks per node (32 tokens each: 3,072 tokens, a little over the longest prompt, so
    one prompt at a time fits whole)."""
    tier_mib: int = 192
    """The host tier's size; the bigger_cache arm splits the same bytes between the engines."""
    pin_share: float = 0.5
    """The share of the tier one tenant's session pins may hold (the tier's ``tenant_pin_share``): the
    bench's sessions are all one tenant's, so this caps what retention pins in all."""
    arms: tuple[str, ...] = ARMS
    """The arms to run (in ``ARMS`` order); a figure of an arm not run is NaN."""
    probes: int = 5
    """Fresh prefixes the probe measures at the end of the tier arm (``bench.kv_probe``); 0: none."""
    max_tokens: int = 16
    dtype: str = "auto"
    block_size: int = 32
    router_port: int = 19300
    node_base_port: int = 19400
    redis_url: str = field(default_factory=lambda: configured_redis_url(db=6))
    model: str | None = None
    workdir: Path = Path(".tandem/bench-kv-cache")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def by_origin(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT medians (ms) of the upper half of the requests by prompt length, by where most of the prompt
    came from (``usage.tandem.kv_origin``)."""
    reqs = [r for run in runs for r in run["per_request"] if r["ok"] and (r.get("tandem") or {}).get("kv_origin")]
    if not reqs:
        return {"local_hit_ttft_ms": float("nan"), "remote_hit_ttft_ms": float("nan"), "miss_ttft_ms": float("nan")}
    cut = statistics.median(r["prompt_tokens"] for r in reqs)
    long = [r for r in reqs if r["prompt_tokens"] >= cut]
    classes: dict[str, list[float]] = {"engine": [], "remote": [], "computed": []}
    for r in long:
        origin = r["tandem"]["kv_origin"]
        amounts = {
            "engine": origin["engine"],
            "remote": origin["host_tier"] + origin.get("peer", 0),
            "computed": origin["computed"],
        }
        for kind, ttfts in classes.items():
            if amounts[kind] >= 0.5 * r["prompt_tokens"]:
                ttfts.append(r["ttft_ms"])
    return {
        "local_hit_ttft_ms": _median(classes["engine"]),
        "remote_hit_ttft_ms": _median(classes["remote"]),
        "miss_ttft_ms": _median(classes["computed"]),
        "long_prompt_tokens": cut,
        "long_requests": {k: len(v) for k, v in classes.items()},
    }


def _spec(cfg: KVCacheBenchConfig, arm: str, extra_blocks: int) -> ClusterSpec:
    tier = arm in ("tier", "retention")
    blocks = cfg.node_blocks + (extra_blocks if arm == "bigger_cache" else 0)
    return ClusterSpec(
        prefill=0,
        decode=0,
        both=cfg.nodes,
        model=cfg.model,
        router_port=cfg.router_port,
        node_base_port=cfg.node_base_port,
        redis_url=cfg.redis_url,
        dtype=cfg.dtype,
        block_size=cfg.block_size,
        policy="cache_aware",
        workdir=cfg.workdir / arm,
        routers=1,
        extra_node_args=(f"--num-gpu-blocks-override={blocks}",),  # (each passed as --engine-arg)
        # vLLM refuses a window its cache cannot hold once; the workload's prompts stay under it
        max_model_len=cfg.workload.context_budget + 4 * cfg.max_tokens,
        host_tier=f"{cfg.tier_mib}MiB" if tier else None,
        tier_env=(("TANDEM_TIER_TENANT_PIN_SHARE", str(cfg.pin_share)),),
        peer_kv=tier,
        router_env=(("TANDEM_ROUTER_SESSION_RETENTION_S", "0" if arm != "retention" else "600"),),
    )


def targets(s: dict[str, float]) -> dict[str, dict[str, Any]]:
    t = {
        "retention_hit >= 0.95 * ceiling_hit": (s["retention_hit"], 0.95 * s["ceiling_hit"]),
        "tier_hit >= bigger_cache_hit + 0.05": (s["tier_hit"], s["bigger_cache_hit"] + 0.05),
        "tier_ttft_p50_ms < engines_ttft_p50_ms": (-s["tier_ttft_p50_ms"], -s["engines_ttft_p50_ms"]),
        "remote_hit_ttft_ms <= 1.3 * local_hit_ttft_ms": (-s["remote_hit_ttft_ms"], -1.3 * s["local_hit_ttft_ms"]),
        "remote_hit_ttft_ms <= 0.5 * miss_ttft_ms": (-s["remote_hit_ttft_ms"], -0.5 * s["miss_ttft_ms"]),
    }
    # (the "<=" targets are written as value >= bound on negated figures; NaN never holds)
    return {k: {"value": abs(v), "bound": abs(b), "held": v >= b} for k, (v, b) in t.items()}


def plot(results: dict[str, dict[str, Any]], summary: dict[str, float], out_png: Path, nodes: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if a in results]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    xs = range(len(arms))
    colors = ["tab:gray", "tab:blue", "tab:orange", "tab:green"][: len(arms)]
    axes[0].bar(xs, [results[a]["hit"] for a in arms], color=colors)
    axes[0].axhline(summary["ceiling_hit"], color="black", ls="--", label="ceiling (unlimited cache)")
    axes[0].set_ylim(0, 1)
    axes[0].set_title("engine-confirmed prefix hit rate")
    axes[0].legend(loc="lower right")
    axes[1].bar([x - 0.2 for x in xs], [results[a]["ttft_p50_ms"] for a in arms], width=0.4, color=colors)
    axes[1].bar([x + 0.2 for x in xs], [results[a]["ttft_p99_ms"] for a in arms], width=0.4, color=colors, alpha=0.4)
    axes[1].set_title("TTFT p50 (solid) and p99 (light), ms")
    kinds = [
        ("local_hit_ttft_ms", "engine's own cache"),
        ("remote_hit_ttft_ms", "host tier or peer"),
        ("miss_ttft_ms", "computed"),
    ]
    axes[2].bar(range(3), [summary[k] for k, _ in kinds], color=["tab:gray", "tab:blue", "tab:red"])
    axes[2].set_xticks(range(3), [label for _, label in kinds])
    axes[2].set_title("idle probe, longest shared prefix: TTFT p50 by origin, ms")
    for ax in axes[:2]:
        ax.set_xticks(list(xs), [a.replace("_", "\n") for a in arms])
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"KV reuse on agent sessions with tool pauses: {nodes} colocated nodes, SmolLM2-135M on CPU")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def run_kv_cache_bench(out: Path, cfg: KVCacheBenchConfig | None = None) -> dict[str, float]:
    cfg = cfg or KVCacheBenchConfig()
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    model_dir = resolve_model(cfg.model)
    layout = layout_from_model(model_dir, resolve_dtype(cfg.dtype), cfg.block_size, os.environ.get("PYTHONHASHSEED"))
    extra_blocks = (cfg.tier_mib << 20) // layout.block_bytes // cfg.nodes  # the tier's bytes, split evenly
    routing = RoutingBenchConfig(workload=cfg.workload, max_tokens=cfg.max_tokens, model=cfg.model)
    runner = _Runner(routing, _Tokens(cfg.model), out.with_suffix(".partial.json"))
    runner.extra["block_bytes"] = layout.block_bytes
    runner.extra["bigger_cache_extra_blocks"] = extra_blocks
    probe: dict[str, Any] = {}
    for arm in (a for a in ARMS if a in cfg.arms):
        with _cluster(_spec(cfg, arm, extra_blocks), f"{arm}: {cfg.nodes} colocated nodes") as cluster:
            model = _model(cluster.url)
            _warm(cluster.url, model, 2)
            nodes = _cluster_view(cluster.url)["nodes"]
            runner.run("kv_cache", arm, cluster.url, model, nodes[0]["block_size"])
            if arm == "tier" and cfg.probes:
                with console.status("tier: probing TTFT by origin at the longest shared prefix…"):
                    a, b = sorted(n["node_id"] for n in nodes)[:2]
                    probe = probe_by_origin(
                        cluster.url,
                        model,
                        (a, b),
                        cfg.workload,
                        runner.tokens.text,
                        n=cfg.probes,
                        max_tokens=cfg.max_tokens,
                    )
                seen = "/".join(str(probe[f"{k}_as_expected"]) for k in ("miss", "local", "remote"))
                console.print(
                    f"{'probe':>34}: {probe['prefix_tokens']} tokens of prefix: miss {probe['miss_ttft_ms']:.0f} ms, "
                    f"local {probe['local_hit_ttft_ms']:.0f} ms, remote {probe['remote_hit_ttft_ms']:.0f} ms "
                    f"(from where expected: {seen})"
                )
    results = runner.results["kv_cache"]
    nan = float("nan")
    summary: dict[str, float] = {
        "ceiling_hit": max(r["ideal_hit"] for r in results.values()),
        **{f"{arm}_hit": results[arm]["hit"] if arm in results else nan for arm in ARMS},
        "engines_ttft_p50_ms": results["engines"]["ttft_p50_ms"] if "engines" in results else nan,
        "tier_ttft_p50_ms": results["tier"]["ttft_p50_ms"] if "tier" in results else nan,
    }
    under_load = by_origin([results[a] for a in ("tier", "retention") if a in results])
    for key in ("local_hit_ttft_ms", "remote_hit_ttft_ms", "miss_ttft_ms"):
        summary[key] = probe.get(key, nan)
    summary = {k: round(v, 4 if k.endswith("hit") else 1) for k, v in summary.items()}
    checks = targets(summary)
    for name, t in checks.items():
        console.print(
            f"{'[green]held' if t['held'] else '[red]MISSED'}[/] {name}: {t['value']:.4g} vs {t['bound']:.4g}"
        )
    doc = {
        "benchmark": "kv-cache",
        "time": started,
        "duration_s": round(time.time() - started, 1),
        "config": {**asdict(replace(cfg)), "workdir": str(cfg.workdir)},
        "results": results,
        "probe": probe,
        "by_origin_under_load": under_load,
        **runner.extra,
        "summary": summary,
        "targets": checks,
    }
    out.write_text(json.dumps(doc, indent=2, default=str))
    runner.partial.unlink(missing_ok=True)
    png = out.with_suffix(".png")
    plot(results, summary, png, cfg.nodes)
    console.print(f"wrote {out} and {png} in {doc['duration_s']:.0f} s")
    return summary


def result_line(summary: dict[str, float]) -> str:
    keys = (
        "ceiling_hit",
        "engines_hit",
        "bigger_cache_hit",
        "tier_hit",
        "retention_hit",
        "engines_ttft_p50_ms",
        "tier_ttft_p50_ms",
        "local_hit_ttft_ms",
        "remote_hit_ttft_ms",
        "miss_ttft_ms",
    )
    return "RESULT " + " ".join(f"{k}={summary.get(k, float('nan'))}" for k in keys)
