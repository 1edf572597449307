"""What ``bench.fleet`` makes of its runs: each arm's figures over its runs, every request as the client saw
it, issue 37's targets, the ``RESULT`` line and the chart. Pure functions of the records, so they are
tested on hand-made runs (``tests/bench/test_fleet.py``) without an engine.

The defaults-against-tier check compares two arms that differ by the host tier alone, a difference
smaller than one round's own spread (a round's wall time moved 4-5% between rounds of one arm on a 2-core
host: the burst of cold first turns places differently, decode steps meet prefills at other times). Two
rounds of each judged it by chance: 0.78-1.24x over 23 runs (``docs/bench/fleet.md``), median 0.98. So
the bench runs extra rounds of the two Tandem arms alone (``FleetBenchConfig.tier_rounds``) and the check
pools every round of both (``targets``'s ``pooled``); the four targets against vllm-router keep the main
rounds, where every arm ran the same content.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.charts import grouped_bars, save, subplots
from bench.histograms import histogram_quantile
from bench.loadgen import SentRequest, percentile

BASELINE = "vllm_router_cache_aware"
TIER_TOLERANCE = 0.97
"""The defaults arm counts as equal to the tier arm down to this share of its sessions per minute."""
TIER_CHECK = "defaults arm >= tier arm (sessions_per_min)"
TANDEM_ARMS = ("tandem", "tandem_tier")
"""The two Tandem arms: the defaults, and the same with a host tier (the check above compares them)."""


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


def targets(
    arms: dict[str, dict[str, Any]], pooled: dict[str, dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """Issue 37's acceptance, each with its value, its bound and whether it held (None: an arm missing).
    ``arms``: the main rounds' figures (every arm, the same content); ``pooled``: the two Tandem arms over
    every round they ran, main and extra, for the defaults-against-tier check (None: ``arms``)."""
    t, v = arms.get("tandem"), arms.get(BASELINE)
    pooled = arms if pooled is None else pooled
    pt, tier = pooled.get("tandem"), pooled.get("tandem_tier")

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
    if pt is not None and tier is not None:
        bound = round(tier["sessions_per_min"] * TIER_TOLERANCE, 3)
        out[TIER_CHECK] = check(pt["sessions_per_min"], bound, pt["sessions_per_min"] >= bound)
    return out


def result_line(result: dict[str, Any]) -> str:
    arms, held = result["arms"], result["targets"]
    figures = " ".join(
        f"{arm}:spm={a['sessions_per_min']},hit={a['hit']},ttft99={a['ttft_p99_ms']},itl50={a['client_itl_p50_ms']}"
        for arm, a in arms.items()
    )
    pooled = result.get("tandem_pooled") or {}
    if set(TANDEM_ARMS) <= pooled.keys():  # what the defaults-against-tier check read
        t, tier = pooled["tandem"], pooled["tandem_tier"]
        figures += (
            f" pooled:tandem={t['sessions_per_min']}/{t['runs']},tandem_tier={tier['sessions_per_min']}/{tier['runs']}"
        )
    n_held = sum(1 for t in held.values() if t["held"])
    missed = [name for name, t in held.items() if t["held"] is False]
    return f"RESULT fleet nodes={result['config']['nodes']} targets_held={n_held}/{len(held)} {figures}" + (
        f" missed={';'.join(missed)}" if missed else ""
    )


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
