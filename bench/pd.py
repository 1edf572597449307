"""`tandem bench pd`: disaggregated (1 prefill + 1 decode node) against colocated (1 node doing both)
on the same machine and model, at several concurrencies. Each mode gets a fresh cluster of real
processes; the load is closed-loop SSE from bench.loadgen.

RESULT line: TTFT p50 at concurrency 1 (the latency a lone agent sees) and output tokens/s at the
highest concurrency (what the cluster can carry), for each mode.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from bench.loadgen import LevelStats, run_level
from contracts.config import redis_url as configured_redis_url
from infra.launcher import Cluster, ClusterSpec

console = Console(stderr=True)


def bench_prompts() -> list[list[dict[str, str]]]:
    """Agent-like prompts: a system prompt, some code, a question; 150-900 prompt tokens."""
    code = "\n".join(f"def step_{i}(state):\n    return state.apply(op_{i}, retries={i % 4})" for i in range(60))
    prompts = []
    for i in range(8):
        body = code[: 400 + 450 * i]
        prompts.append(
            [
                {"role": "system", "content": "You are a coding agent. Answer with a short plan."},
                {"role": "user", "content": f"Task {i}: refactor this module.\n```python\n{body}\n```"},
            ]
        )
    return prompts


@dataclass(frozen=True)
class PdBenchConfig:
    concurrencies: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 64
    requests_per_level: int = 0
    """0: max(8, 2 x concurrency)."""
    router_port: int = 18500
    node_base_port: int = 18600
    redis_url: str = field(default_factory=lambda: configured_redis_url(db=9))
    """$TANDEM_REDIS_URL's server, database 9: the benchmark's own."""
    model: str | None = None


async def _measure(cluster: Cluster, cfg: PdBenchConfig, mode: str) -> list[LevelStats]:
    import httpx

    async with httpx.AsyncClient() as client:
        model = (await client.get(f"{cluster.url}/v1/models")).json()["data"][0]["id"]
    prompts = bench_prompts()
    # One warm-up request per prompt shape so the first measured request does not pay one-off costs.
    await run_level(cluster.url, model, prompts[:2], 1, 2, 4)
    levels = []
    with Progress(console=console, transient=True) as progress:
        for c in cfg.concurrencies:
            n = cfg.requests_per_level or max(8, 2 * c)
            task = progress.add_task(f"{mode} c={c}", total=n)
            stats, _ = await run_level(
                cluster.url, model, prompts, c, n, cfg.max_tokens, on_done=lambda t=task: progress.advance(t)
            )
            levels.append(stats)
            console.print(
                f"{mode:>14} c={c:<3} TTFT p50 {stats.ttft_p50_ms:8.1f} ms  p99 {stats.ttft_p99_ms:8.1f} ms"
                f"  ITL p50 {stats.itl_p50_ms:6.1f} ms  {stats.output_tok_s:7.1f} tok/s"
                f"  errors {stats.errors}"
            )
    return levels


def _run_mode(cfg: PdBenchConfig, mode: str, workdir: Path) -> list[LevelStats]:
    spec = ClusterSpec(
        prefill=1 if mode == "disaggregated" else 0,
        decode=1 if mode == "disaggregated" else 0,
        both=0 if mode == "disaggregated" else 1,
        model=cfg.model,
        router_port=cfg.router_port,
        node_base_port=cfg.node_base_port,
        redis_url=cfg.redis_url,
        workdir=workdir / mode,
    )
    cluster = Cluster(spec)
    cluster.start()
    try:
        with console.status(f"starting {mode} cluster…") as status:
            cluster.wait_ready(on_progress=lambda m: status.update(f"starting {mode} cluster… {m}"))
        return asyncio.run(_measure(cluster, cfg, mode))
    finally:
        cluster.stop()


def plot(results: dict[str, list[dict[str, Any]]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = [
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"),
        ("itl_p50_ms", "ITL p50 (ms)"),
        ("output_tok_s", "output tokens/s"),
    ]
    for ax, (key, title) in zip(axes, panels, strict=True):
        for mode, levels in results.items():
            xs = [lv["concurrency"] for lv in levels]
            ax.plot(xs, [lv[key] for lv in levels], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Tandem: disaggregated (1P+1D) vs colocated (1 node), SmolLM2-135M on CPU")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def run_pd_bench(out: Path, cfg: PdBenchConfig | None = None) -> dict[str, Any]:
    cfg = cfg or PdBenchConfig()
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(".tandem") / "bench-pd"
    results: dict[str, list[dict[str, Any]]] = {}
    for mode in ("disaggregated", "colocated"):
        results[mode] = [lv.as_dict() for lv in _run_mode(cfg, mode, workdir)]
    pd, colo = results["disaggregated"], results["colocated"]
    summary = {
        "pd_ttft_p50_ms": round(pd[0]["ttft_p50_ms"], 1),
        "colo_ttft_p50_ms": round(colo[0]["ttft_p50_ms"], 1),
        "pd_tok_s": round(pd[-1]["output_tok_s"], 1),
        "colo_tok_s": round(colo[-1]["output_tok_s"], 1),
    }
    doc = {
        "benchmark": "pd",
        "time": time.time(),
        "config": cfg.__dict__,
        "results": results,
        "summary": summary,
        "summary_definitions": {
            "*_ttft_p50_ms": f"TTFT p50 at concurrency {cfg.concurrencies[0]}",
            "*_tok_s": f"output tokens/s at concurrency {cfg.concurrencies[-1]}",
        },
    }
    out.write_text(json.dumps(doc, indent=2))
    png = out.with_suffix(".png")
    plot(results, png)
    console.print(f"wrote {out} and {png}")
    return summary
