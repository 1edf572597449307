"""Measuring a real engine over HTTP for the step model (``profiling.fit``), as a client sees it.

- prefill: for each prompt length, ``repeats`` requests one at a time, each a fresh random prompt (token
  ids, so no cache holds it; the engine's reported ``cached_tokens`` is taken off anyway), ``max_tokens=1``:
  the time to the first token is one prefill step.
- prefill after a cached prefix: for each of ``prefix_contexts``, one fresh prompt of that length is
  sent (a fresh prefill point itself), then ``repeats`` prompts that extend it by each of
  ``prefix_new`` fresh tokens: the engine reuses the prefix and computes only the new tokens, which
  attend over it (``PrefillPoint.context_tokens``: what the engine reported it reused);
- decode: for each context length ``c`` of ``contexts``, one fresh prompt of ``c`` tokens is prefilled
  (a fresh prefill point itself), then for each batch size ``batch`` streams start together, each that
  prefix plus ``DECODE_TAIL`` fresh tokens, ``decode_tokens`` tokens each (``ignore_eos``). The prefix
  is shared so that 16 streams at 2.4k context fit a small KV cache and cost seconds, not minutes, of
  prefill (16 fresh 2.4k prompts would be 38k tokens: over a minute on one core here); attention still
  reads every stream's context. The quarter-quantile of the gaps between tokens (``FAST_STEPS``) once
  every stream has made ``DECODE_WARM`` tokens (all prompts prefilled), until the first mixed prompt is
  sent, is one decode step at that batch and context. ``unshared`` adds a few batches of distinct fresh prompts (each
  stream its own context), which read ``batch`` times the KV that a shared prefix is read once for.
- mixed: while that batch decodes, a fresh prompt of each of ``mixed_prefill`` tokens (``max_tokens=1``)
  is sent in, one at a time, ``MIXED_SPACING`` tokens apart; the step that computes it also makes a
  token of every stream, so the streams' gap that ends with its first token is one step of both (a
  colocated node's steps in a replay are mostly of this kind: a prompt chunk beside running decodes).

The engine behind ``url`` may be a node or a router in front of nodes; on a shared machine, measure each
engine with the others idle, then ``neighbour_slowdown``: engines pinned to cores of their own still
share the memory bus and caches, and a sweep run on every engine at once gives each point a neighbour
of random busyness, where the simulator knows when a neighbour computes (``StepModel.shared_slowdown``).
On a shared 2-core VM a neighbour cost little (1.08-1.65x a decode step, 0.94-1.04x a prefill, in
the noise) and most of the spread was the engine's own two step speeds (``FAST_STEPS``). Behind a router, a batch of
streams may be spread over several nodes, so a decode point is one node's step only when ``url`` is that
node's engine (``headers``: its API key).

``first_tokens`` times fresh prompts alone (``max_tokens=1``) at given lengths, with any headers (a
forced route): ``tandem bench sim`` compares such times through the router and straight to an
engine to measure what the router and the P/D handover add.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from profiling.fit import DecodePoint, MixedPoint, PrefillPoint
from replay.client import Outcome, send

DECODE_TAIL = 16
"""Fresh tokens after the shared prefix in each decode stream's prompt (its own, so no two are equal)."""
DECODE_WARM = 3
"""Tokens every stream has made before gaps count as decode steps (the batch's prompts all done)."""
MIXED_START = 16
"""Tokens every stream has made when the first mixed prompt goes in (gaps from DECODE_WARM to here are
the pure decode point: 13 steps, so that a host's slow episode of a few steps moves their median little;
7 steps, as points once had, sometimes fell wholly in one, ``profiling.fit.SLOW_EPISODE``)."""
FAST_STEPS = 25
"""A decode point is this percentile of its gaps, not their median: on a shared 2-core VM an
engine's steps run at one of two speeds (~70 or ~160 ms for one stream), and right after a sweep's
prefills the slow one can hold most of a 13-step window (a 40-token stream's gaps: 159, 153, 57, 162,
160, 158, 158, 62, 69, 161, ...), while a replay's median step is a fast one (one stream: 67-72 ms in
every replay). The quarter-quantile reads the fast steps when a window holds some; a window wholly
slow is left out by the fit (``profiling.fit.SLOW_EPISODE``)."""
MIXED_SPACING = 4
"""Tokens every stream makes after one mixed prompt's answer before the next goes in."""


@dataclass(frozen=True)
class Sweep:
    prefill_tokens: tuple[int, ...] = (64, 256, 512, 1024, 2048)
    repeats: int = 3
    prefix_contexts: tuple[int, ...] = ()
    """Cached prefix lengths for prefill points after a prefix (none: only fresh prompts)."""
    prefix_new: tuple[int, ...] = (32, 256)
    """New tokens after each cached prefix."""
    batches: tuple[int, ...] = (1, 4, 8, 16)
    contexts: tuple[int, ...] = (256, 1024, 2304)
    """Shared prefix of the decode streams (each adds ``DECODE_TAIL`` tokens of its own)."""
    decode_tokens: int = 48
    """Tokens a decode stream makes; enough for the mixed prompts (``min_decode_tokens``)."""
    mixed_prefill: tuple[int, ...] = (256, 1024)
    """Fresh prompt lengths sent into each decode batch (none: no mixed points)."""
    unshared: tuple[tuple[int, int], ...] = ((4, 1024), (8, 384))
    """(batch, context) decode points whose streams share nothing (distinct fresh prompts): beside the
    shared-prefix points they tell the per-stream arithmetic from the cache reads."""
    vocab: tuple[int, int] = (1000, 30000)

    def __post_init__(self) -> None:
        if self.decode_tokens < self.min_decode_tokens:
            raise ValueError(f"decode_tokens {self.decode_tokens} < {self.min_decode_tokens} the sweep needs")

    @property
    def min_decode_tokens(self) -> int:
        """Enough tokens for the pure decode window and every mixed prompt, with a step to spare each."""
        if not self.mixed_prefill:
            return DECODE_WARM + 4
        return MIXED_START + len(self.mixed_prefill) * (MIXED_SPACING + 2) + 2


async def _one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    ids: list[int],
    max_tokens: int,
    headers: dict[str, str],
    on_chunk: Callable[[Outcome], None] | None = None,
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
    out = await send(client, url.rstrip("/") + "/v1/completions", body, headers, on_chunk=on_chunk)
    if out.status != "ok" or not out.chunk_times:
        why = out.error or "the stream ended without a token"
        raise RuntimeError(f"profiling request failed: {why} (HTTP {out.http_status})")
    return [out.sent, *out.chunk_times], out.cached_tokens or 0


async def first_tokens(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    lengths: tuple[int, ...],
    repeats: int,
    rng: random.Random,
    vocab: tuple[int, int],
    headers: dict[str, str] | None = None,
) -> list[PrefillPoint]:
    """Time to first token of fresh prompts sent one at a time (``max_tokens=1``); uncached tokens are
    the prompt less what the engine reports it reused."""
    out: list[PrefillPoint] = []
    for n in lengths:
        for _ in range(repeats):
            ids = [rng.randrange(*vocab) for _ in range(n)]
            times, cached = await _one(client, url, model, ids, 1, headers or {})
            out.append(PrefillPoint(n - cached, times[1] - times[0]))
    return out


class _Batch:
    """Token counts of a batch of streams as their chunks arrive, so that a prompt can be sent in once
    every stream has made a given number of tokens."""

    def __init__(self, n: int) -> None:
        self.counts = [0] * n
        self.ended = 0
        self._moved = asyncio.Event()

    def watch(self, i: int) -> Callable[[Outcome], None]:
        def on_chunk(out: Outcome) -> None:
            self.counts[i] = len(out.chunk_times)
            self._moved.set()

        return on_chunk

    def end(self) -> None:
        self.ended += 1
        self._moved.set()

    async def reach(self, n: int) -> bool:
        """Whether every stream made ``n`` tokens (False once one has ended first)."""
        while min(self.counts) < n:
            if self.ended:
                return False
            self._moved.clear()
            await self._moved.wait()
        return True


@dataclass(frozen=True)
class Sent:
    """A mixed prompt sent into a decode batch: its computed tokens, when it went and its first token."""

    tokens: int
    sent: float
    first: float


def decode_gaps(streams: list[list[float]], warm: int, until: float) -> list[float]:
    """Gaps between tokens (chunk times of each stream) that end once every stream has made ``warm``
    tokens and no later than ``until``: steps of the batch decoding alone."""
    gate = max(t[warm - 1] for t in streams)
    out: list[float] = []
    for t in streams:
        ends = np.asarray(t[1:])
        gaps = np.diff(t)
        out += gaps[(ends > gate) & (ends <= until)].tolist()
    return out


def mixed_gap(streams: list[list[float]], first: float) -> tuple[float, float] | None:
    """(the streams' median gap ending with a mixed prompt's first token, the median count of tokens
    made before that gap's start): one step that computed the prompt beside the batch. A stream counts
    when one of its tokens came within a quarter of that gap of the prompt's first token (the step's
    outputs are sent out together); None when none did."""
    gaps, made = [], []
    for t in streams:
        arr = np.asarray(t)
        i = int(np.argmin(np.abs(arr - first)))
        if i < 1:
            continue
        gap = arr[i] - arr[i - 1]
        if abs(arr[i] - first) <= 0.25 * gap:
            gaps.append(gap)
            made.append(i)
    if not gaps:
        return None
    return float(np.median(gaps)), float(np.median(made))


@dataclass(frozen=True)
class Points:
    """Everything one sweep measured (``profiling.fit.fit_step_model``'s input)."""

    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    mixed: list[MixedPoint]


async def measure(
    url: str,
    model: str,
    sweep: Sweep,
    *,
    seed: int = 0,
    headers: dict[str, str] | None = None,
    progress: Callable[[str], None] = print,
) -> Points:
    rng = random.Random(seed)
    hdrs = headers or {}

    def fresh(n: int) -> list[int]:
        return [rng.randrange(*sweep.vocab) for _ in range(n)]

    prefill: list[PrefillPoint] = []
    decode: list[DecodePoint] = []
    mixed: list[MixedPoint] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await _one(client, url, model, fresh(16), 2, hdrs)  # warm the path
        for n in sweep.prefill_tokens:
            prefill += await first_tokens(client, url, model, (n,), sweep.repeats, rng, sweep.vocab, hdrs)
            progress(f"prefill {n} tokens: {np.median([p.seconds for p in prefill[-sweep.repeats :]]) * 1e3:.0f} ms")
        for ctx in sweep.prefix_contexts:
            prefix = fresh(ctx)
            times, cached = await _one(client, url, model, prefix, 1, hdrs)
            prefill.append(PrefillPoint(ctx - cached, times[1] - times[0], cached))
            for n in sweep.prefix_new:
                for _ in range(sweep.repeats):
                    times, cached = await _one(client, url, model, prefix + fresh(n), 1, hdrs)
                    prefill.append(PrefillPoint(ctx + n - cached, times[1] - times[0], cached))
                got = prefill[-sweep.repeats :]
                progress(
                    f"prefill {n} tokens after {got[-1].context_tokens} cached: "
                    f"{np.median([p.seconds for p in got]) * 1e3:.0f} ms"
                )
        for ctx in sweep.contexts:
            prefix = fresh(ctx)
            times, cached = await _one(client, url, model, prefix, 1, hdrs)
            prefill.append(PrefillPoint(ctx - cached, times[1] - times[0], cached))
            for b in sweep.batches:
                prompts = [prefix + fresh(DECODE_TAIL) for _ in range(b)]
                d, m = await _decode_batch(client, url, model, hdrs, sweep, prompts, ctx, sweep.mixed_prefill, fresh)
                decode.append(d)
                mixed += m
                note = ", ".join(f"{p.prefill_tokens} beside it {p.seconds * 1e3:.0f} ms" for p in m)
                progress(
                    f"decode batch {b} context {ctx}: {d.seconds * 1e3:.1f} ms a step" + (f"; {note}" if m else "")
                )
        for b, ctx in sweep.unshared:
            prompts = [fresh(ctx) for _ in range(b)]
            d, _ = await _decode_batch(client, url, model, hdrs, sweep, prompts, 0, (), fresh)
            decode.append(d)
            progress(f"decode batch {b} of distinct {ctx}-token prompts: {d.seconds * 1e3:.1f} ms a step")
    return Points(prefill, decode, mixed)


async def _decode_batch(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    hdrs: dict[str, str],
    sweep: Sweep,
    prompts: list[list[int]],
    shared: int,
    mixed_prefill: tuple[int, ...],
    fresh: Callable[[int], list[int]],
) -> tuple[DecodePoint, list[MixedPoint]]:
    """A stream for each of ``prompts`` (their first ``shared`` tokens the same), and the mixed prompts
    sent in while they decode."""
    b = len(prompts)
    batch = _Batch(b)

    async def stream(i: int) -> list[float]:
        try:
            times, _ = await _one(client, url, model, prompts[i], sweep.decode_tokens, hdrs, batch.watch(i))
        finally:
            batch.end()
        return times[1:]

    async def send_in() -> list[Sent]:
        out: list[Sent] = []
        if not mixed_prefill or not await batch.reach(MIXED_START):
            return out
        for k in mixed_prefill:
            times, cached = await _one(client, url, model, fresh(k), 1, hdrs)
            out.append(Sent(k - cached, times[0], times[1]))
            if not await batch.reach(min(batch.counts) + MIXED_SPACING):
                break
        return out

    sending = asyncio.ensure_future(send_in())
    streams = list(await asyncio.gather(*(stream(i) for i in range(b))))
    sent = await sending
    until = sent[0].sent if sent else float("inf")
    gaps = decode_gaps(streams, DECODE_WARM, until) or decode_gaps(streams, DECODE_WARM, float("inf"))
    if not gaps:
        raise RuntimeError(f"decode batch {b}: no gap between tokens after the first {DECODE_WARM}")
    ctx = float(np.mean([len(p) for p in prompts]))

    def kv(made: float) -> float:  # distinct KV tokens held: the shared prefix once, the rest per stream
        return shared + b * (ctx - shared + made)

    made = (DECODE_WARM + (MIXED_START if sent else sweep.decode_tokens)) / 2
    point = DecodePoint(b, ctx + made, float(np.percentile(gaps, FAST_STEPS)), kv(made))
    mixed = []
    for s in sent:
        got = mixed_gap(streams, s.first)
        if got is not None:
            mixed.append(MixedPoint(s.tokens, b, ctx + got[1], got[0], kv(got[1]) + s.tokens))
    return point, mixed


BUSY_PROMPT, BUSY_TOKENS = 512, 16
"""What the neighbours run while ``neighbour_slowdown`` probes: back-to-back fresh prompts of this many
tokens with answers of this many, a replay node's mix of prefill and decode steps."""


@dataclass(frozen=True)
class Slowdown:
    """A node's steps alone and beside busy neighbours on its host (``neighbour_slowdown``)."""

    decode_alone_s: list[float]
    decode_busy_s: list[float]
    prefill_alone_s: list[float]
    prefill_busy_s: list[float]

    @property
    def decode(self) -> float:
        return float(np.median(self.decode_busy_s) / np.median(self.decode_alone_s))

    @property
    def prefill(self) -> float:
        return float(np.median(self.prefill_busy_s) / np.median(self.prefill_alone_s))

    @property
    def factor(self) -> float:
        """One step multiplier for both kinds of step (their geometric mean): the step model's
        ``shared_slowdown``."""
        return float(np.sqrt(self.decode * self.prefill))


async def neighbour_slowdown(
    url: str,
    neighbours: list[str],
    model: str,
    *,
    seed: int = 0,
    headers: dict[str, str] | None = None,
    batch: int = 8,
    context: int = 1024,
    prefill_tokens: int = 768,
    rounds: int = 1,
    vocab: tuple[int, int] = (1000, 30000),
    progress: Callable[[str], None] = print,
) -> Slowdown:
    """How much slower ``url``'s engine steps while the engines at ``neighbours`` (same host) compute: a
    decode batch's step (``_decode_batch``'s point) and a fresh prompt's time to first token, alone and
    beside neighbours kept busy (``BUSY_PROMPT``), in the order alone, busy, busy, alone (``rounds``
    times), so a drift of the host cancels. Measure the profile's points with the neighbours idle, then this."""
    rng = random.Random(seed)
    hdrs = headers or {}
    sweep = Sweep(mixed_prefill=(), decode_tokens=24, vocab=vocab)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(*vocab) for _ in range(n)]

    out: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def keep_busy(other: str, stop: asyncio.Event) -> None:
            while not stop.is_set():
                await _one(client, other, model, fresh(BUSY_PROMPT), BUSY_TOKENS, hdrs)

        async def probe(busy: bool) -> None:
            stop = asyncio.Event()
            loads = [asyncio.ensure_future(keep_busy(o, stop)) for o in neighbours] if busy else []
            try:
                prefix = fresh(context)
                await _one(client, url, model, prefix, 1, hdrs)
                prompts = [prefix + fresh(DECODE_TAIL) for _ in range(batch)]
                point, _ = await _decode_batch(client, url, model, hdrs, sweep, prompts, context, (), fresh)
                got = await first_tokens(client, url, model, (prefill_tokens,), 3, rng, vocab, hdrs)
            finally:
                stop.set()
                await asyncio.gather(*loads)
            out[busy][0].append(point.seconds)
            out[busy][1].append(float(np.median([p.seconds for p in got])))
            progress(
                f"{'beside busy neighbours' if busy else 'alone'}: decode step {point.seconds * 1e3:.0f} ms, "
                f"{prefill_tokens}-token prefill {out[busy][1][-1] * 1e3:.0f} ms"
            )

        for _ in range(rounds):
            for busy in (False, True):
                await probe(busy)
            for busy in (True, False):
                await probe(busy)
    return Slowdown(out[False][0], out[True][0], out[False][1], out[True][1])
