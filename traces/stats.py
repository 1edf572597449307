"""What a trace holds (``tandem trace stats``) and its cache-hit ceiling.

The ceiling is the hit rate of an infinite prefix cache that has seen every earlier request's prompt
(in arrival order): for each request, its longest prefix of full ``block_size`` blocks whose hashes
were seen before, capped as vLLM caps it (the last prompt token is always computed, so at most
``(input_tokens - 1) // block_size`` blocks hit). Two figures:

- by tokens: hit tokens / prompt tokens, the figure an engine's ``cached_tokens`` is compared with;
- by blocks: base blocks (partial last blocks included) whose hash was seen before / all base blocks,
  the figure Mooncake's own README gives for its trace (no cap, no regrouping).

Outputs never count: a trace knows the blocks of prompts only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from traces.hashing import regroup
from traces.schema import Trace


@dataclass(frozen=True)
class Ceiling:
    block_size: int
    hit_tokens: int
    prompt_tokens: int
    hit_blocks: int
    """Base blocks seen before (``by_blocks``)."""
    base_blocks: int

    @property
    def by_tokens(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def by_blocks(self) -> float:
        return self.hit_blocks / self.base_blocks if self.base_blocks else 0.0


def per_request_ceiling(trace: Trace, block_size: int) -> list[int]:
    """Each request's ceiling hit tokens (infinite cache, arrival order), at ``block_size``."""
    seen: set[int] = set()
    out: list[int] = []
    base = trace.meta.block_tokens
    for hashes, n_in in zip(
        trace.table.column("block_hashes").to_pylist(), trace.table.column("input_tokens").to_pylist(), strict=True
    ):
        blocks = regroup(hashes, n_in, base, block_size)
        cap = (n_in - 1) // block_size
        hit = 0
        for h in blocks[:cap]:
            if h not in seen:
                break
            hit += 1
        out.append(hit * block_size)
        seen.update(blocks)
    return out


def ceiling(trace: Trace, block_size: int) -> Ceiling:
    hits = per_request_ceiling(trace, block_size)
    seen: set[int] = set()
    hit_blocks = total = 0
    for hashes in trace.table.column("block_hashes").to_pylist():
        for h in hashes:
            hit_blocks += h in seen
            seen.add(h)
        total += len(hashes)
    prompt = int(np.sum(trace.table.column("input_tokens").to_numpy()))
    return Ceiling(block_size, sum(hits), prompt, hit_blocks, total)


@dataclass(frozen=True)
class TraceStats:
    requests: int
    sessions: int
    duration_s: float
    input_tokens: dict[str, float]
    """mean, p50, p90, p99, max."""
    output_tokens: dict[str, float]
    turns_per_session: dict[str, float]
    gap_s: dict[str, float]
    """Of the requests with a recorded gap; empty when none has one."""
    cancelled: int
    observed_cached_tokens: int | None
    """Sum of the recorded ``cached_tokens`` (null when none was recorded)."""
    ceiling: Ceiling


def _summary(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {}
    return {
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p90": float(np.percentile(values, 90)),
        "p99": float(np.percentile(values, 99)),
        "max": float(values.max()),
    }


def trace_stats(trace: Trace, block_size: int) -> TraceStats:
    t = trace.table
    arrival = t.column("arrival_s").to_numpy()
    per_session = list(Counter(s for s in t.column("session_id").to_pylist() if s is not None).values())
    gaps = np.array([g for g in t.column("gap_s").to_pylist() if g is not None], dtype=float)
    cached = [c for c in t.column("cached_tokens").to_pylist() if c is not None]
    return TraceStats(
        requests=t.num_rows,
        sessions=len(per_session),
        duration_s=float(arrival.max() - arrival.min()) if t.num_rows else 0.0,
        input_tokens=_summary(t.column("input_tokens").to_numpy()),
        output_tokens=_summary(t.column("output_tokens").to_numpy()),
        turns_per_session=_summary(np.asarray(per_session, dtype=float)),
        gap_s=_summary(gaps),
        cancelled=t.num_rows - t.column("cancel_after_s").null_count,
        observed_cached_tokens=sum(cached) if cached else None,
        ceiling=ceiling(trace, block_size),
    )
