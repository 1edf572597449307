"""From a trace to the requests a replay sends: lengths rescaled to the model's context window, and
token-id prompts whose shared prefixes are the trace's shared prefixes.

Rescaling. The trace's prompts are cut into *units* of ``unit_tokens`` trace tokens, and each unit is
sent as one engine block (``block_size`` tokens): the scale factor is ``block_size / unit_tokens``.
``unit_tokens`` is a multiple or a divisor of the trace's base block (``traces.hashing.regroup``
places unit boundaries exactly) and at least ``block_size`` (a replay only ever shrinks). The auto
choice is the smallest such unit at which the trace's longest request (prompt + output) fits the
context window; ``unit_tokens`` may also be given. A unit is a full engine block, so a unit shared in
the trace is a block the engine can share, and the hit structure is kept at the trace's resolution.
A prompt's tail shorter than a unit becomes ``round(tail · scale)`` tokens; outputs scale by the same
factor (at least 1). A request that still does not fit (only when ``unit_tokens`` was given) loses
the end of its prompt; the count is reported.

Tokens. Unit u's tokens are ``block_token_ids(hash_u, block_size)``: equal unit hashes, equal tokens.
The tail's tokens come from its own hash (the last base block's), so they never extend a shared prefix
by accident. Prompts are sent to ``/v1/completions`` as token ids, so no tokenizer or chat template
stands between the trace's structure and the engine's prefix cache.

The expected hit tokens of each request (``ceiling_tokens``) are those of an infinite cache over the
prompts as sent, in arrival order, capped as vLLM caps them (``(prompt - 1) // block_size`` blocks):
the replay's ceiling, printed next to the hit rate observed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from traces.hashing import TraceError, block_token_ids, chain, regroup
from traces.schema import Trace


@dataclass(frozen=True)
class Scaling:
    unit_tokens: int
    """Trace tokens sent as one engine block."""
    block_size: int
    """Engine block size (tokens)."""
    context_window: int
    """The model's context window (tokens)."""
    truncated: int
    """Requests whose prompt was cut to fit."""

    @property
    def factor(self) -> float:
        return self.block_size / self.unit_tokens

    def describe(self) -> str:
        if self.unit_tokens == self.block_size and not self.truncated:
            return f"lengths as recorded (context window {self.context_window})"
        return (
            f"lengths scaled by {self.factor:.4g} ({self.unit_tokens} trace tokens -> one {self.block_size}-token "
            f"block) to fit the context window {self.context_window}; {self.truncated} prompts cut to fit"
        )


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    request_id: str
    session_id: str | None
    parent_index: int | None
    turn: int
    arrival_s: float
    gap_s: float | None
    cancel_after_s: float | None
    prompt: list[int]
    max_tokens: int
    ceiling_tokens: int


def _candidates(base: int, block_size: int, longest: int) -> list[int]:
    divisors = [d for d in range(block_size, base + 1) if base % d == 0]
    multiples = [base * k for k in range(2, longest // base + 2)]
    return [u for u in [*divisors, *multiples] if u >= block_size and u % block_size == 0]


def choose_unit(trace: Trace, block_size: int, context_window: int) -> int:
    """The smallest unit (least scaling) at which every request of ``trace`` fits ``context_window``."""
    t = trace.table
    n_in = t.column("input_tokens").to_numpy()
    n_out = t.column("output_tokens").to_numpy()
    longest = int((n_in + n_out).max())
    for u in _candidates(trace.meta.block_tokens, block_size, longest):
        f = block_size / u
        sent = (n_in // u) * block_size + np.round((n_in % u) * f) + np.maximum(1, np.round(n_out * f))
        if int(sent.max()) <= context_window:
            return u
    raise TraceError(f"no scaling fits the trace's longest request ({longest} tokens) into {context_window}")


def plan(
    trace: Trace,
    *,
    block_size: int,
    context_window: int,
    unit_tokens: int | None = None,
    vocab: tuple[int, int] = (1000, 32000),
) -> tuple[list[PlannedRequest], Scaling]:
    base = trace.meta.block_tokens
    unit = unit_tokens or choose_unit(trace, block_size, context_window)
    if unit < block_size or unit % block_size or (unit % base and base % unit):
        raise TraceError(
            f"unit_tokens {unit} must be at least the block size {block_size}, a multiple of it, "
            f"and a multiple or divisor of the trace's base block {base}"
        )
    factor = block_size / unit
    rows = trace.table.to_pylist()
    index_of = {r["request_id"]: i for i, r in enumerate(rows)}
    seen: set[int] = set()
    truncated = 0
    out: list[PlannedRequest] = []
    for i, r in enumerate(rows):
        n_in, hashes = r["input_tokens"], r["block_hashes"]
        units = regroup(hashes, n_in, base, unit)
        tail = round((n_in - len(units) * unit) * factor)
        max_tokens = max(1, round(r["output_tokens"] * factor))
        room = context_window - max_tokens
        if room < 1:
            raise TraceError(f"request {r['request_id']}: {max_tokens} output tokens leave no room for a prompt")
        if len(units) * block_size + tail > room:
            truncated += 1
            units = units[: room // block_size]
            tail = min(tail, room - len(units) * block_size)
        prompt: list[int] = []
        for h in units:
            prompt.extend(block_token_ids(h, block_size, vocab).tolist())
        if tail:
            prompt.extend(block_token_ids(chain(hashes[-1], struct.pack("<I", 0xFFFFFFFF)), tail, vocab).tolist())
        if not prompt:  # a prompt shorter than one scaled token still sends one
            prompt = block_token_ids(hashes[-1], 1, vocab).tolist()
        hit = 0
        for h in units[: (len(prompt) - 1) // block_size]:
            if h not in seen:
                break
            hit += 1
        seen.update(units)
        parent = r["parent_request_id"]
        out.append(
            PlannedRequest(
                index=i,
                request_id=r["request_id"],
                session_id=r["session_id"],
                parent_index=index_of.get(parent) if parent is not None else None,
                turn=r["turn"],
                arrival_s=r["arrival_s"],
                gap_s=r["gap_s"],
                cancel_after_s=r["cancel_after_s"],
                prompt=prompt,
                max_tokens=max_tokens,
                ceiling_tokens=hit * block_size,
            )
        )
    return out, Scaling(unit, block_size, context_window, truncated)
