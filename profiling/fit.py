"""The step model's fit: non-negative least squares over measured points (eight coefficients, so every
subset of them is fitted with ``numpy.linalg.lstsq`` and the best non-negative fit kept: exact, no scipy).

Two kinds of point, both from a real engine seen over HTTP (``profiling.measure``):

- prefill: one request alone, ``max_tokens=1``, whose prompt is ``context_tokens`` cached tokens (none
  for a fresh prompt) and ``uncached_tokens`` new ones; its time to first token is one step that
  prefills them plus the request's way in and back (HTTP, the API server): ``base +
  prefill_s_per_token * uncached + prefill_s_per_ctx_pair * uncached * context +
  prefill_s_per_new_pair * uncached² / 2 + request_overhead``.
- decode: ``batch`` streams decoding together at a mean context ``context_tokens``; the median gap
  between tokens is one step: ``base + decode_s_per_seq * batch + decode_s_per_ctx_token * batch * ctx
  + decode_s_per_kv_token * kv`` (``kv``: the distinct KV tokens held, ``batch * ctx`` when the streams
  share nothing, about ``ctx`` when they share one prefix: the two kinds of point tell the per-stream
  arithmetic from the cache reads).
- mixed: a fresh prompt of ``prefill_tokens`` computed in the same step as ``batch`` streams decode (the
  streams' gap that ends with the prompt's first token): the prefill terms and the decode terms of one
  step, no request overhead. These points are what ties the two kinds of work together where a
  colocated node runs them: without them the model adds a prefill measured alone to a decode measured
  alone and nothing checks the sum.

One shared ``base_s`` ties the two together (it is one engine's step); a gap between two tokens of a
stream pays no request overhead, so the decode points separate the step's base from the overhead the
prefill points carry. Non-negative, because a negative coefficient fitted to noise would make a
simulated step shorter as it does more. The overhead is what the measured URL adds: an engine's own
HTTP server, or a router in front of it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from simulator.step_model import StepModel


@dataclass(frozen=True)
class PrefillPoint:
    uncached_tokens: int
    seconds: float
    context_tokens: int = 0
    """Cached prompt tokens before the uncached ones (they are attended to, not computed)."""

    @property
    def ctx_pairs(self) -> float:
        """(computed token, cached token) pairs its attention covers."""
        return float(self.uncached_tokens * self.context_tokens)

    @property
    def new_pairs(self) -> float:
        """(computed token, earlier computed token) pairs its attention covers."""
        return self.uncached_tokens**2 / 2


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context_tokens: float
    """Mean context (prompt + generated) of the streams during the measurement."""
    seconds: float
    kv_tokens: float | None = None
    """Distinct KV tokens held on the engine meanwhile (streams sharing a prefix hold it once); None:
    nothing shared, ``batch * context_tokens``."""

    @property
    def kv(self) -> float:
        return self.batch * self.context_tokens if self.kv_tokens is None else self.kv_tokens


@dataclass(frozen=True)
class MixedPoint:
    prefill_tokens: int
    """Fresh prompt tokens computed in the step (no cached context)."""
    batch: int
    """Streams decoding a token in the same step."""
    context_tokens: float
    """Their mean context."""
    seconds: float
    kv_tokens: float | None = None
    """Distinct KV tokens held meanwhile, the prompt's included; None: ``batch * context_tokens``
    (nothing shared) plus the prompt."""

    @property
    def new_pairs(self) -> float:
        return self.prefill_tokens**2 / 2

    @property
    def kv(self) -> float:
        if self.kv_tokens is None:
            return self.batch * self.context_tokens + self.prefill_tokens
        return self.kv_tokens


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    best, best_res = np.zeros(a.shape[1]), float(np.sum(y**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(a.shape[1])
            coef[list(cols)] = sol
            res = float(np.sum((a @ coef - y) ** 2))
            if res < best_res:
                best, best_res = coef, res
    return best


def _group_medians(points: list[PrefillPoint]) -> list[PrefillPoint]:
    """Each point's time replaced by the median of its repeats (same uncached and cached tokens): on a
    shared host another job's burst makes one repeat of three take a third longer, and least squares
    would follow it half way; the median of three ignores it. The repeats keep their weight."""
    groups: dict[tuple[int, int], list[float]] = {}
    for p in points:
        groups.setdefault((p.uncached_tokens, p.context_tokens), []).append(p.seconds)
    return [replace(p, seconds=float(np.median(groups[(p.uncached_tokens, p.context_tokens)]))) for p in points]


SLOW_EPISODE = 0.3
"""A point this much slower than the fit of the others is left out (``SLOW_ROUNDS`` times at most): on
a shared 2-core VM an engine's steps run at one of two speeds, ~70 ms or ~160 ms for the same decode
step, in episodes of one to dozens of steps (measured there, one engine, its neighbour idle: a
40-token stream's gaps 72, 73, 75, 159, 77, ...; another's median 160 ms), so a decode point timed over
a few steps sometimes lands wholly in a slow episode. The noise only ever adds time, so only points
above the fit go; a replay's median step is a fast one (67-69 ms at one stream in both configurations'
replays), which the kept points describe."""
SLOW_ROUNDS = 3
MIN_POINTS = 10


def fit_step_model(
    prefill: list[PrefillPoint],
    decode: list[DecodePoint],
    mixed: list[MixedPoint] | None = None,
    *,
    base: StepModel | None = None,
    source: str = "",
) -> tuple[StepModel, float]:
    """The fitted model (transfer and KV-size fields kept from ``base``) and the fit's relative RMS error over
    the points it kept (``SLOW_EPISODE``)."""
    if len(prefill) < 2 or len(decode) < 2:
        raise ValueError("need at least two prefill and two decode points")
    mixed = mixed or []
    prefill = _group_medians(prefill)
    rows = [[1.0, p.uncached_tokens, 0.0, 0.0, 1.0, p.ctx_pairs, p.new_pairs, 0.0] for p in prefill]
    rows += [[1.0, 0.0, d.batch, d.batch * d.context_tokens, 0.0, 0.0, 0.0, d.kv] for d in decode]
    rows += [[1.0, m.prefill_tokens, m.batch, m.batch * m.context_tokens, 0.0, 0.0, m.new_pairs, m.kv] for m in mixed]
    y = np.array([p.seconds for p in prefill] + [d.seconds for d in decode] + [m.seconds for m in mixed])
    a = np.array(rows)
    keep = np.ones_like(y, dtype=bool)
    for _ in range(SLOW_ROUNDS + 1):
        # weight each point by 1/y so that short steps (decode) count as much as long ones (prefill)
        coef = nnls(a[keep] / y[keep, None], np.ones(int(keep.sum())))
        pred = a @ coef
        slow = keep & (y > pred * (1.0 + SLOW_EPISODE))
        if not slow.any() or (keep & ~slow).sum() < MIN_POINTS:
            break
        keep &= ~slow
    rel_rms = float(np.sqrt(np.mean(((pred[keep] - y[keep]) / y[keep]) ** 2)))
    m = replace(
        base or StepModel(),
        base_s=float(coef[0]),
        prefill_s_per_token=float(coef[1]),
        decode_s_per_seq=float(coef[2]),
        decode_s_per_ctx_token=float(coef[3]),
        request_overhead_s=float(coef[4]),
        prefill_s_per_ctx_pair=float(coef[5]),
        prefill_s_per_new_pair=float(coef[6]),
        decode_s_per_kv_token=float(coef[7]),
        source=source or "fitted",
    )
    return m, rel_rms
