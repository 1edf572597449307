"""`tandem bench routing`: how much prefill each routing policy saves on coding-agent traffic.

Workload: bench.agent_workload (sessions over shared repositories, 6-10 growing turns), replayed with
real SSE by bench.loadgen.run_sessions (sessions arrive open loop; turns follow answers). Each run gets
fresh content (a salt in the shared system prompt), so no run warms another.

Part 2, on 2 prefill + 1 decode node: one run per Tandem policy (cache_aware, least_loaded,
round_robin), each through its own router process over the same engines. Part 3, on 2 colocated
nodes: Tandem's cache_aware against vllm-router 0.1.17 --policy cache_aware and --policy kv_aware
(fed by the nodes' KV events), same workload and engines.

Per run: the engine-confirmed hit rate (sum of usage.prompt_tokens_details.cached_tokens, the reuse
the engine that prefilled reports, over prompt tokens), TTFT p50/p99, prefill tokens computed (prompt
minus cached), and ideal_hit: what one cache of unlimited size would reuse on the same request
sequence (router.kv_index.ideal, from the requests' token blocks in the order they were sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress

from bench.agent_workload import AgentWorkloadConfig, build_sessions
from bench.loadgen import SentRequest, percentile, run_sessions
from bench.vllm_router import EventRelay, PeerWorker, VllmRouter, require_vllm_router
from contracts.config import redis_url as configured_redis_url
from infra.launcher import Cluster, ClusterSpec
from node_agent.model import resolve_model
from node_agent.settings import NodeSettings
from router.kv_index.ideal import ideal_cached_tokens
from router.policies import PolicyName
from router.tokenizer import _load, _token_ids

console = Console(stderr=True)
TANDEM_POLICIES = tuple(p.value for p in PolicyName)
PEER_POLICIES = ("cache_aware", "kv_aware")
"""vllm-router's own policy names (``bench.vllm_router``), not ours."""


@dataclass(frozen=True)
class RoutingBenchConfig:
    workload: AgentWorkloadConfig = field(default_factory=AgentWorkloadConfig)
    policies: tuple[str, ...] = TANDEM_POLICIES
    pd: bool = True
    """Part 2 (2 prefill + 1 decode nodes, one run per Tandem policy)."""
    peer: bool = True
    """Part 3 (colocated pair, Tandem vs vllm-router)."""
    max_tokens: int = 16
    router_port: int = 19000
    """Tandem routers use router_port.. router_port+4, vllm-router +50 (metrics +51), event relays +60.."""
    node_base_port: int = 19100
    redis_url: str = field(default_factory=lambda: configured_redis_url(db=10))
    """$TANDEM_REDIS_URL's server, database 10: the benchmark's own."""
    kv_cache_gib: int = 1
    """Per node (float32: ~23k tokens). Part 2 (3 engines, 4 routers) needs ~14 GB of RAM."""
    dtype: str = "float32"
    """This machine's CPU (AVX2, no AVX-512/bf16) prefills ~2x faster in float32 than in bfloat16."""
    block_size: int = 32
    """The CPU backend's smallest efficient block: a turn's few new tokens are not lost to 128-token rounding."""
    model: str | None = None
    workdir: Path = Path(".tandem/bench-routing")


class _Tokens:
    """The served model's tokenizer and chat template, exactly as the router renders prompts."""

    def __init__(self, model: str | None) -> None:
        self.tok = _load(str(resolve_model(model)))

    def text(self, s: str) -> int:
        return len(self.tok(s, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return _token_ids(self.tok, {"messages": messages})


@contextlib.contextmanager
def _cluster(spec: ClusterSpec, what: str) -> Iterator[Cluster]:
    cluster = Cluster(spec)
    try:
        cluster.start()
        with console.status(f"starting {what}…") as status:
            cluster.wait_ready(on_progress=lambda m: status.update(f"starting {what}… {m}"))
        yield cluster
    finally:
        with console.status(f"stopping {what}…"):
            cluster.stop()


def _warm(url: str, model: str, n: int) -> None:
    for _ in range(n):
        httpx.post(
            f"{url}/v1/chat/completions",
            timeout=300,
            json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "warm up"}]},
        ).raise_for_status()


def _summarize(
    sent: list[SentRequest], ids: dict[tuple[str, int], list[int]], block_size: int, wall_s: float
) -> dict[str, Any]:
    ok = [s for s in sent if s.result.ok and s.result.usage]
    prompt = sum(s.result.usage["prompt_tokens"] for s in ok)
    cached = sum((s.result.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for s in ok)
    order = [ids[(s.session_id, s.turn)] for s in sorted(sent, key=lambda s: s.sent_s)]
    ideal = sum(ideal_cached_tokens(order, block_size)) / max(1, sum(len(t) for t in order))
    ttft = [s.result.ttft_s * 1000 for s in ok]
    tandem = [s.result.usage.get("tandem") or {} for s in ok]
    predicted = [t for t in tandem if t.get("routed_cached_tokens") is not None]
    return {
        "requests": len(sent),
        "errors": len(sent) - len(ok),
        "wall_s": round(wall_s, 1),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit": cached / prompt if prompt else 0.0,
        "ideal_hit": ideal,
        "prefill_tokens": prompt - cached,
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "e2e_p50_ms": percentile([s.result.e2e_s * 1000 for s in ok], 0.5),
        "late_session_starts_s": round(sum(s.late_s for s in sent), 2),
        "prompt_token_mismatches": sum(s.result.usage["prompt_tokens"] != len(ids[(s.session_id, s.turn)]) for s in ok),
        "modes": dict(Counter(t.get("mode") or "n/a" for t in tandem)),
        "routed_equals_engine": (
            sum(t["routed_cached_tokens"] == t["engine_cached_tokens"] for t in predicted) / len(predicted)
        )
        if predicted
        else None,
        "per_request": [
            {
                "session": s.session_id,
                "turn": s.turn,
                "sent_s": round(s.sent_s, 3),
                "ok": s.result.ok,
                "ttft_ms": round(s.result.ttft_s * 1000, 1),
                "prompt_tokens": (s.result.usage or {}).get("prompt_tokens"),
                "cached_tokens": ((s.result.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
                "tandem": (s.result.usage or {}).get("tandem"),
                "error": s.result.error,
            }
            for s in sent
        ],
    }


class _Runner:
    """Runs the workload once per (part, name), each time with fresh content, and keeps the results;
    after every run the JSON so far is written to ``partial`` (a crashed bench still leaves its data)."""

    def __init__(self, cfg: RoutingBenchConfig, tokens: _Tokens, partial: Path) -> None:
        self.cfg, self.tokens, self.partial = cfg, tokens, partial
        self.nonce = uuid.uuid4().hex[:8]
        self.results: dict[str, dict[str, Any]] = {}
        self.extra: dict[str, Any] = {}

    def run(
        self,
        part: str,
        name: str,
        url: str,
        model: str,
        block_size: int,
        after: Callable[[], dict[str, float]] | None = None,
    ) -> dict[str, Any]:
        """One run; ``after`` adds what the router itself counted (``router_metrics``)."""
        label = f"{part} {name}"
        salt = f"run-{sum(map(len, self.results.values())):02d}-{self.nonce}"
        with console.status(f"{label}: building the workload…"):
            sessions = build_sessions(self.cfg.workload, salt, self.tokens.text, lambda m: len(self.tokens.prompt(m)))
            ids = {(s.session_id, i): self.tokens.prompt(m) for s in sessions for i, m in enumerate(s.turns)}
        start = time.perf_counter()
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"{label}", total=len(ids))
            sent = asyncio.run(
                run_sessions(url, model, sessions, self.cfg.max_tokens, on_done=lambda _: progress.advance(task))
            )
        stats = _summarize(sent, ids, block_size, time.perf_counter() - start)
        if after is not None:
            stats["router_metrics"] = after()
        console.print(
            f"{label:>34}: hit {stats['hit']:.3f} (ideal {stats['ideal_hit']:.3f})  "
            f"TTFT p50 {stats['ttft_p50_ms']:7.0f} ms  p99 {stats['ttft_p99_ms']:7.0f} ms  "
            f"prefilled {stats['prefill_tokens']:>7} tok  errors {stats['errors']}  {stats['wall_s']} s"
        )
        self.results.setdefault(part, {})[name] = stats
        self.partial.write_text(json.dumps({"results": self.results, **self.extra}, indent=2, default=str))
        return stats


def _cluster_view(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/cluster", timeout=10).json()


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def _replicas(a: str, b: str) -> dict[str, Any]:
    """Two cache_aware router replicas, each subscribed to the KV events itself: their fleet indexes
    (cached blocks per node) after the same traffic."""
    time.sleep(2.0)  # let the last KV events land
    views = {u: {n["node_id"]: n["cached_blocks"] for n in _cluster_view(u)["nodes"]} for u in (a, b)}
    return {"serving_replica": views[a], "idle_replica": views[b], "same_index": views[a] == views[b]}


def _spec(cfg: RoutingBenchConfig, part: str, **shape: Any) -> ClusterSpec:
    """A part's cluster: its shape and policy, the benchmark's model, ports, Redis, cache and workdir."""
    return ClusterSpec(
        model=cfg.model,
        router_port=cfg.router_port,
        node_base_port=cfg.node_base_port,
        redis_url=cfg.redis_url,
        kv_cache_gib=cfg.kv_cache_gib,
        dtype=cfg.dtype,
        block_size=cfg.block_size,
        workdir=cfg.workdir / part,
        **shape,
    )


def _part_pd(cfg: RoutingBenchConfig, runner: _Runner) -> None:
    spec = _spec(cfg, "pd", prefill=2, decode=1, policy=cfg.policies[0])
    with _cluster(spec, "2 prefill + 1 decode nodes") as cluster:
        urls = {cfg.policies[0]: cluster.url}
        for i, policy in enumerate(cfg.policies[1:], start=1):
            urls[policy] = cluster.add_router(cfg.router_port + i, policy)
        rr = urls.get(PolicyName.ROUND_ROBIN) or cluster.add_router(cfg.router_port + 3, PolicyName.ROUND_ROBIN)
        replica = cluster.add_router(cfg.router_port + 4, PolicyName.CACHE_AWARE, "router-replica")
        with console.status("starting the other routers…"):
            for url in {*urls.values(), rr, replica} - {cluster.url}:
                cluster.wait_router(url)
            model = _model(cluster.url)
            _warm(rr, model, 2 * spec.prefill)  # every P->D pair has done its first transfer
        block_size = _cluster_view(cluster.url)["nodes"][0]["block_size"]
        for policy in cfg.policies:
            runner.run("pd", policy, urls[policy], model, block_size)
            if policy == PolicyName.CACHE_AWARE:
                runner.extra["replicas"] = _replicas(urls[policy], replica)


def _part_colocated(cfg: RoutingBenchConfig, runner: _Runner) -> None:
    spec = _spec(
        cfg,
        "colocated",
        prefill=0,
        decode=0,
        both=2,
        policy=PolicyName.CACHE_AWARE,
        extra_node_args=("--enable-scale-out",),
    )
    with _cluster(spec, "2 colocated nodes") as cluster:
        model = _model(cluster.url)
        view = _cluster_view(cluster.url)["nodes"]
        block_size = view[0]["block_size"]
        runner.run("colocated", "tandem_cache_aware", cluster.url, model, block_size)
        for policy in PEER_POLICIES:
            with contextlib.ExitStack() as stack:
                workers = []
                for i, n in enumerate(view):
                    ns = NodeSettings(port=int(n["url"].rsplit(":", 1)[1]))
                    events = ns.kv_events_endpoint
                    if policy == "kv_aware" and events.startswith("ipc://"):
                        events = stack.enter_context(EventRelay(events, cfg.router_port + 60 + i)).endpoint
                    workers.append(PeerWorker(url=n["url"], kv_events=events, kv_replay=ns.kv_replay_endpoint))
                peer = VllmRouter(
                    port=cfg.router_port + 50,
                    policy=policy,
                    workers=workers,
                    block_size=block_size,
                    model=model,
                    log=cluster.logs / f"vllm-router-{policy}.log",
                    metrics_port=cfg.router_port + 51,
                )
                with console.status(f"starting vllm-router --policy {policy}…"):
                    stack.enter_context(peer)
                    _warm(peer.url, model, 2)
                runner.run(
                    "colocated", f"vllm_router_{policy}", peer.url, model, block_size, after=peer.scrape_routing_metrics
                )


def _targets(s: dict[str, float]) -> dict[str, dict[str, Any]]:
    t = {
        "cache_hit >= 0.95 * ideal_hit": (
            s["cache_hit"],
            0.95 * s["ideal_hit"],
            s["cache_hit"] >= 0.95 * s["ideal_hit"],
        ),
        "1 - cache_hit <= 0.75 * (1 - rr_hit)": (
            1 - s["cache_hit"],
            0.75 * (1 - s["rr_hit"]),
            1 - s["cache_hit"] <= 0.75 * (1 - s["rr_hit"]),
        ),
        "cache_ttft_p50_ms < rr_ttft_p50_ms": (
            s["cache_ttft_p50_ms"],
            s["rr_ttft_p50_ms"],
            s["cache_ttft_p50_ms"] < s["rr_ttft_p50_ms"],
        ),
    }
    if s.get("peer_hit") == s.get("peer_hit"):  # not NaN: part 3 ran
        t["colo_cache_hit >= peer_hit"] = (s["colo_cache_hit"], s["peer_hit"], s["colo_cache_hit"] >= s["peer_hit"])
    return {k: {"value": round(v, 4), "bound": round(b, 4), "held": ok} for k, (v, b, ok) in t.items()}


def plot(results: dict[str, dict[str, Any]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{part}\n{name}".replace("vllm_router_", "vllm-router\n") for part, runs in results.items() for name in runs
    ]
    rows = [r for runs in results.values() for r in runs.values()]
    colors = ["tab:blue" if part == "pd" else "tab:orange" for part, runs in results.items() for _ in runs]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    xs = range(len(rows))
    axes[0].bar(xs, [r["hit"] for r in rows], color=colors)
    axes[0].scatter(
        xs, [r["ideal_hit"] for r in rows], marker="_", s=600, color="black", label="ideal (unlimited cache)"
    )
    axes[0].set_ylim(0, 1)
    axes[0].set_title("engine-confirmed prefix hit rate")
    axes[0].legend(loc="lower right")
    axes[1].bar([x - 0.2 for x in xs], [r["ttft_p50_ms"] for r in rows], width=0.4, color=colors, label="p50")
    axes[1].bar(
        [x + 0.2 for x in xs], [r["ttft_p99_ms"] for r in rows], width=0.4, color=colors, alpha=0.45, label="p99"
    )
    axes[1].set_title("TTFT (ms)")
    axes[1].legend()
    axes[2].bar(xs, [r["prefill_tokens"] for r in rows], color=colors)
    axes[2].set_title("prompt tokens prefilled (not from cache)")
    for ax in axes:
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Routing on a coding-agent workload: 2P+1D (blue) and 2 colocated nodes (orange), SmolLM2-135M on CPU")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def run_routing_bench(out: Path, cfg: RoutingBenchConfig | None = None) -> dict[str, float]:
    cfg = cfg or RoutingBenchConfig()
    if cfg.peer:
        require_vllm_router()  # fail before starting engines, not after 15 minutes
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runner = _Runner(cfg, _Tokens(cfg.model), out.with_suffix(".partial.json"))
    if cfg.pd:
        _part_pd(cfg, runner)
    if cfg.peer:
        _part_colocated(cfg, runner)
    results = runner.results
    pd = results.get("pd", {})
    nan = float("nan")
    ca, rr = pd.get(PolicyName.CACHE_AWARE, {}), pd.get(PolicyName.ROUND_ROBIN, {})
    summary = {
        "cache_hit": ca.get("hit", nan),
        "ideal_hit": ca.get("ideal_hit", nan),
        "rr_hit": rr.get("hit", nan),
        "cache_ttft_p50_ms": ca.get("ttft_p50_ms", nan),
        "rr_ttft_p50_ms": rr.get("ttft_p50_ms", nan),
        "colo_cache_hit": nan,
        "peer_hit": nan,
        "colo_cache_ttft_p50_ms": nan,
        "peer_ttft_p50_ms": nan,
    }
    if cfg.peer:
        colo = results["colocated"]
        best = max((colo[f"vllm_router_{p}"] for p in PEER_POLICIES), key=lambda r: r["hit"])
        summary.update(
            colo_cache_hit=colo["tandem_cache_aware"]["hit"],
            peer_hit=best["hit"],
            colo_cache_ttft_p50_ms=colo["tandem_cache_aware"]["ttft_p50_ms"],
            peer_ttft_p50_ms=best["ttft_p50_ms"],
        )
    summary = {k: round(v, 4 if k.endswith("hit") else 1) for k, v in summary.items()}
    targets = _targets(summary) if ca and rr else {}
    for name, t in targets.items():
        console.print(f"{'[green]held' if t['held'] else '[red]MISSED'}[/] {name}: {t['value']} vs {t['bound']}")
    doc = {
        "benchmark": "routing",
        "time": started,
        "duration_s": round(time.time() - started, 1),
        "config": {**asdict(cfg), "workdir": str(cfg.workdir)},
        "results": results,
        "replicas": runner.extra.get("replicas"),
        "summary": summary,
        "targets": targets,
    }
    out.write_text(json.dumps(doc, indent=2, default=str))
    runner.partial.unlink(missing_ok=True)
    png = out.with_suffix(".png")
    plot(results, png)
    console.print(f"wrote {out} and {png} in {doc['duration_s']:.0f} s")
    return summary
