"""``tandem bench chaos``'s report: answers and failures over time, the PNG timeline with the faults
marked, and the RESULT line."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.chaos_workload import Request


def timeline(requests: list[Request], t0: float, t_end: float, bin_s: float = 5.0) -> list[dict[str, float]]:
    """Answers/s and failures/s per ``bin_s`` bin of request end times."""
    n = max(1, int((t_end - t0) / bin_s) + 1)
    ok = [0] * n
    bad = [0] * n
    for r in requests:
        if r.outcome == "running" or r.end < t0:
            continue
        i = min(n - 1, int((r.end - t0) / bin_s))
        (ok if r.outcome == "ok" else bad)[i] += 1
    return [{"t_s": i * bin_s, "answers_per_s": ok[i] / bin_s, "failures_per_s": bad[i] / bin_s} for i in range(n)]


def plot(doc: dict[str, Any], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = doc["timeline"]
    fig, ax = plt.subplots(figsize=(14, 4.5))
    bin_s = tl[1]["t_s"] - tl[0]["t_s"] if len(tl) > 1 else 5.0
    xs = [b["t_s"] + bin_s / 2 for b in tl]
    answers = [b["answers_per_s"] for b in tl]
    # Closed-loop streams on a slow engine finish in waves, so 5 s bins alternate between bursts and
    # nothing; a trailing 30 s mean shows the service level, the faint bins what happened when.
    width = max(1, round(30 / bin_s))
    smooth = [sum(answers[max(0, i - width + 1) : i + 1]) / min(width, i + 1) for i in range(len(answers))]
    ax.plot(xs, answers, color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(xs, smooth, label="answers/s (trailing 30 s)", color="tab:blue", lw=2)
    ax.plot(xs, [b["failures_per_s"] for b in tl], label="failed requests/s", color="tab:red")
    top = max(answers + [b["failures_per_s"] for b in tl] + [1.0])
    for f in doc["faults"]:
        ax.axvline(f["at_s"], color="black", lw=0.8, ls="--")
        if f["recovery_s"] is not None:
            ax.axvspan(f["at_s"], f["at_s"] + f["recovery_s"], color="orange", alpha=0.15)
        ax.text(f["at_s"], top * 1.02, f["fault"].replace("_", " "), rotation=30, fontsize=7, va="bottom")
    ax.set_xlabel("seconds since the load started")
    ax.set_ylabel("per second (5 s bins)")
    ax.set_ylim(0, top * 1.35)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    s = doc["summary"]
    ax.set_title(
        f"Tandem {doc.get('benchmark', 'chaos')}: {s['survived']}/{s['faults']} faults survived, "
        f"{s['failed_requests']} failed "
        f"({s.get('failed_elsewhere', 0)} not on the killed component), {s['hung_streams']} hung, "
        f"{s['lost_lake_rows']} lake rows lost (recovery shaded)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def result_line(summary: dict[str, Any]) -> str:
    keys = (
        "faults",
        "survived",
        "hung_streams",
        "stranded_blocks",
        "lost_lake_rows",
        "failed_requests",
        "failed_elsewhere",
        "recovery_p50_s",
        "recovery_max_s",
    )
    return "RESULT " + " ".join(f"{k}={summary[k]}" for k in keys)
