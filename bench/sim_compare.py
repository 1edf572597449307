"""``tandem bench sim``'s comparison: how far the SIMULATOR lands from the real replay, per metric and per
configuration, whether it ranks the configurations as they measured, where each request went in both,
and the table and plot of it all (no engines here: ``--from-json`` re-renders a recorded run)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from simulator.fleet import SIMULATED

if TYPE_CHECKING:
    from bench.sim import LiveNodeView


RELATIVE = ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "output_tok_s")


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
