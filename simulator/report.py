"""SIMULATOR: a run's figures in the replay's terms (``traces.figures.RunFigures``, which
``replay.results.Summary`` extends too), so a simulated run and a real replay of the same trace compare
metric by metric (``bench/sim.py``).

TTFT is arrival to first token; ITL the gaps between a request's tokens, pooled over requests (as the
replay pools its chunk gaps); throughput output tokens over first arrival to last finish; the hit rate
the prefilling node's reused tokens over prompt tokens (vLLM's ``num_cached_tokens``, what ``usage``
reports)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.fleet import SIMULATED, FleetSim, SimRequest
from traces.figures import RunFigures


@dataclass(frozen=True, kw_only=True)
class SimSummary(RunFigures):
    requests: int
    label: str = SIMULATED


def summarize(sim: FleetSim, reqs: list[SimRequest]) -> SimSummary:
    if not reqs:
        raise ValueError("no requests simulated")
    ttft = np.array([(r.first_token_s or r.arrival_s) - r.arrival_s for r in reqs])
    gaps = [np.diff(sim.token_times(r)) for r in reqs if r.output_tokens > 1]
    itl = np.concatenate(gaps) if gaps else np.zeros(1)
    wall = max(r.finish_s or 0.0 for r in reqs) - min(r.arrival_s for r in reqs)
    prompt = sum(r.prompt_tokens for r in reqs)
    return SimSummary(
        requests=len(reqs),
        wall_s=wall,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p90_s=float(np.percentile(ttft, 90)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        itl_p50_s=float(np.percentile(itl, 50)),
        itl_p90_s=float(np.percentile(itl, 90)),
        output_tok_s=sum(r.output_tokens for r in reqs) / wall if wall > 0 else float("nan"),
        observed_hit=sum(r.engine_cached_tokens for r in reqs) / prompt if prompt else float("nan"),
    )
