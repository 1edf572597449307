"""Measuring a real engine over HTTP for the step model (``profiling.fit``), as a client sees it.

- prefill: for each prompt length, ``repeats`` requests one at a time, each a fresh random prompt (token
  ids, so no cache holds it; the engine's reported ``cached_tokens`` is taken off anyway), ``max_tokens=1``:
  the time to the first token is one prefill step.
- decode: for each batch size and context length, ``batch`` streams started together with fresh prompts,
  ``decode_tokens`` tokens each (``ignore_eos``); the median gap between tokens over the second half of
  every stream (when every prompt has been prefilled and only decoding is left) is one decode step at
  that batch, at a mean context of prompt + three quarters of the tokens.

The engine behind ``url`` may be a node or a router in front of nodes; on a shared machine, measure with
every engine of the configuration running (they share the cores), since the profile must describe the
nodes as they will run.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from profiling.fit import DecodePoint, PrefillPoint
from replay.client import send


@dataclass(frozen=True)
class Sweep:
    prefill_tokens: tuple[int, ...] = (64, 256, 512, 1024, 2048)
    repeats: int = 3
    batches: tuple[int, ...] = (1, 4, 8, 16)
    contexts: tuple[int, ...] = (128, 1024)
    decode_tokens: int = 48
    vocab: tuple[int, int] = (1000, 30000)


async def _one(
    client: httpx.AsyncClient, url: str, model: str, ids: list[int], max_tokens: int
) -> tuple[list[float], int]:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    out = await send(client, url.rstrip("/") + "/v1/completions", body, {})
    if out.status != "ok" or not out.chunk_times:
        raise RuntimeError(f"profiling request failed: {out.error}")
    return [out.sent, *out.chunk_times], out.cached_tokens or 0


async def measure(
    url: str, model: str, sweep: Sweep, *, seed: int = 0, progress: Callable[[str], None] = print
) -> tuple[list[PrefillPoint], list[DecodePoint]]:
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(*sweep.vocab) for _ in range(n)]

    prefill: list[PrefillPoint] = []
    decode: list[DecodePoint] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await _one(client, url, model, fresh(16), 2)  # warm the path
        for n in sweep.prefill_tokens:
            for _ in range(sweep.repeats):
                times, cached = await _one(client, url, model, fresh(n), 1)
                prefill.append(PrefillPoint(n - cached, times[1] - times[0]))
            progress(f"prefill {n} tokens: {np.median([p.seconds for p in prefill[-sweep.repeats :]]) * 1e3:.0f} ms")
        for ctx in sweep.contexts:
            for b in sweep.batches:
                streams = await asyncio.gather(
                    *(_one(client, url, model, fresh(ctx), sweep.decode_tokens) for _ in range(b))
                )
                gaps = np.concatenate([np.diff(t[1:])[len(t) // 2 :] for t, _ in streams])
                point = DecodePoint(b, ctx + 0.75 * sweep.decode_tokens, float(np.median(gaps)))
                decode.append(point)
                progress(f"decode batch {b} context {ctx}: {point.seconds * 1e3:.1f} ms a step")
    return prefill, decode
