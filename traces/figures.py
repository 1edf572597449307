"""The figures a run of a trace is judged by, whoever ran it: the replay against a live cluster
(``replay.results.Summary``) or the simulator (``simulator.report.SimSummary``). One definition, so the two
compare field by field (``bench/sim.py``).

TTFT is arrival to first token; ITL the gaps between a request's tokens, pooled over requests; throughput
output tokens over first arrival to last finish; the hit rate reused prompt tokens over prompt tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RunFigures:
    wall_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p90_s: float
    output_tok_s: float
    observed_hit: float
