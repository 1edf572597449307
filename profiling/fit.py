"""The step model's fit: non-negative least squares over measured points (four coefficients, so every
subset of them is fitted with ``numpy.linalg.lstsq`` and the best non-negative fit kept: exact, no scipy).

Two kinds of point, both from a real engine seen over HTTP (``profiling.measure``):

- prefill: one request alone with a prompt no cache holds, ``max_tokens=1``; its time to first token
  is one step that prefills ``uncached_tokens``: ``base + prefill_s_per_token * uncached``.
- decode: ``batch`` streams decoding together at a mean context ``context_tokens``; the median gap
  between tokens is one step: ``base + decode_s_per_seq * batch + decode_s_per_ctx_token * batch * ctx``.

One shared ``base_s`` ties the two together (it is one engine's step). Non-negative, because a negative
coefficient fitted to noise would make a simulated step shorter as it does more. The HTTP round trip
and the router are in every point; that is as a client sees them, and as the replay measures.
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


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context_tokens: float
    """Mean context (prompt + generated) of the streams during the measurement."""
    seconds: float


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
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


def fit_step_model(
    prefill: list[PrefillPoint], decode: list[DecodePoint], *, base: StepModel | None = None, source: str = ""
) -> tuple[StepModel, float]:
    """The fitted model (transfer and KV-size fields kept from ``base``) and the fit's relative RMS error."""
    if len(prefill) < 2 or len(decode) < 2:
        raise ValueError("need at least two prefill and two decode points")
    rows = [[1.0, p.uncached_tokens, 0.0, 0.0] for p in prefill]
    rows += [[1.0, 0.0, d.batch, d.batch * d.context_tokens] for d in decode]
    y = np.array([p.seconds for p in prefill] + [d.seconds for d in decode])
    a = np.array(rows)
    # weight each point by 1/y so that short steps (decode) count as much as long ones (prefill)
    coef = _nnls(a / y[:, None], np.ones_like(y))
    pred = a @ coef
    rel_rms = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
    m = replace(
        base or StepModel(),
        base_s=float(coef[0]),
        prefill_s_per_token=float(coef[1]),
        decode_s_per_seq=float(coef[2]),
        decode_s_per_ctx_token=float(coef[3]),
        source=source or "fitted",
    )
    return m, rel_rms
