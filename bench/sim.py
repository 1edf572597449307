"""``tandem bench sim`` (NOT DONE: the comparison below is built and tested; the part that replays the
trace on the real cluster, 1P+1D and two colocated nodes, profiles them and simulates them is not
written yet).

The comparison: per configuration, the relative error of the simulated TTFT p50 and p90, ITL p50 and
throughput against the real replay's, and the absolute error of the hit rate; ``plan_matches_real``
is 1 when the simulator ranks the configurations as they measured (by TTFT p90, the planner's
deciding figure). The RESULT line reports, per metric, the worse of the configurations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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
