"""``tandem bench overhead``'s report: the arms' figures averaged over rounds (with their spread), the
targets, the plot and the RESULT line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARMS = ("plain", "peer", "node", "tandem")
"""Plain ``vllm serve``, vllm-router in front of it, a Tandem node straight to its engine, Tandem through its router."""


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 3) if values else float("nan")


def summarize(rounds: list[dict[str, Any]], arms: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per arm: the mean over rounds of each figure, with its range."""
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        runs = [r["arms"][arm] for r in rounds if arm in r["arms"]]
        serve = [x["vllm_bench"] for x in runs]
        s: dict[str, Any] = {}
        for key in ("req_s", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "router_cpu_ms_per_req"):
            vals = [x[key] for x in serve if x.get(key) is not None]
            if vals:
                s[key] = _mean(vals)
                s[f"{key}_range"] = [min(vals), max(vals)]
        agents = [x["agent"] for x in runs if x.get("agent")]
        if agents:
            s["agent_req_s"] = _mean([a["req_s"] for a in agents])
            s["agent_ttft_p50_ms"] = _mean([a["ttft_p50_ms"] for a in agents if a["ttft_p50_ms"] is not None])
            s["agent_failed"] = sum(a["failed"] for a in agents)
        s["failed"] = sum(x["failed"] for x in serve)
        out[arm] = s
    return out


def targets(result: dict[str, float]) -> dict[str, dict[str, Any]]:
    plain, peer, node, tandem = (result[k] for k in ("plain_rps", "peer_rps", "node_rps", "tandem_rps"))
    checks = {
        "tandem_rps >= 0.95 * plain_rps": tandem >= 0.95 * plain,
        "tandem_rps >= peer_rps": tandem >= peer,
        "node_rps >= 0.97 * plain_rps": node >= 0.97 * plain,
        "tandem_ttft_p50_ms <= 1.10 * plain_ttft_p50_ms": result["tandem_ttft_p50_ms"]
        <= 1.10 * result["plain_ttft_p50_ms"],
        "router_cpu_ms_per_req <= 8": result["router_cpu_ms_per_req"] <= 8,
        "router_chunks_per_s >= 20000": result["router_chunks_per_s"] >= 20000,
    }
    return {k: {"met": bool(v)} for k, v in checks.items()}


def plot(doc: dict[str, Any], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if a in doc["summary"]]
    s = doc["summary"]
    colors = {"plain": "#4c72b0", "peer": "#8172b2", "node": "#55a868", "tandem": "#dd8452"}
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.4))
    panels = (
        ("req_s", "requests/s (vllm bench serve)"),
        ("ttft_p50_ms", "TTFT p50, ms"),
        ("tpot_p50_ms", "TPOT p50, ms"),
        ("router_cpu_ms_per_req", "router CPU ms / request"),
    )
    for ax, (key, title) in zip(axes, panels, strict=True):
        xs = [a for a in arms if key in s[a]]
        vals = [s[a][key] for a in xs]
        err = [
            [max(0.0, v - s[a][f"{key}_range"][0]) for a, v in zip(xs, vals, strict=True)],
            [max(0.0, s[a][f"{key}_range"][1] - v) for a, v in zip(xs, vals, strict=True)],
        ]  # rounding
        ax.bar(xs, vals, yerr=err, capsize=4, color=[colors[a] for a in xs])
        for i, (a, v) in enumerate(zip(xs, vals, strict=True)):
            top = s[a][f"{key}_range"][1]  # above the range whisker, not on it
            ax.annotate(
                f"{v:.2f}" if v < 100 else f"{v:.0f}",
                (i, top),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=9,
            )
        if key == "req_s" and "plain" in s:
            ax.axhline(0.95 * s["plain"]["req_s"], color="k", linestyle=":", label="95% of plain")
            ax.legend(fontsize=8, loc="lower right")
        if key == "router_cpu_ms_per_req":
            ax.axhline(8, color="k", linestyle=":", label="target 8 ms")
            ax.legend(fontsize=8)
        ax.set_title(title)
    r = doc["result"]
    fig.suptitle(
        f"tandem bench overhead: {doc['config']['num_prompts']} prompts × {doc['config']['rounds']} rounds, "
        f"{doc['config']['input_len']} in / {doc['config']['output_len']} out, concurrency "
        f"{doc['config']['concurrency']}, {doc['host']['cpus']} cores — router ceiling "
        f"{r['router_chunks_per_s']:,.0f} chunks/s on one core (stand-in engine)"
    )
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def result_line(result: dict[str, float]) -> str:
    return "RESULT " + " ".join(f"{k}={v}" for k, v in result.items())
