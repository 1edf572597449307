"""``tandem trace synth agentic``: a seeded synthetic trace of coding-agent sessions.

The shape (every number a field of ``AgenticSpec``):

- sessions arrive as a Poisson process (``session_rate`` per second);
- each session opens with one of ``system_prompts`` shared system prompts (picked with Zipf weights,
  so a few are common), then one of ``repositories`` shared repository contexts (Zipf too): sessions on
  the same repository share that prefix as well;
- then a first user message; each turn's answer (``output_tokens``) and the tool result that follows
  it (``tool_tokens``) are appended, so every turn's prompt extends the previous turn's prompt and
  answer: the growing context of an agent loop;
- between a turn's end and the next turn lies the tool's time (``gap_s``, lognormal), recorded as
  ``gap_s``; a session has a geometric number of turns (mean ``turns_mean``) and stops early when its
  prompt would pass ``max_input_tokens``.

Block hashes come from the segments (``traces.hashing.chain_segments``), so the shared system prompts,
repositories and earlier turns are shared prefixes exactly. ``arrival_s`` of a later turn assumes a
nominal service time of the previous turn (``nominal_ttft_s`` + ``nominal_tpot_s`` per output token)
so that an open-loop replay has times to follow; a closed-loop replay uses ``gap_s`` after the real
answer instead. Same spec, same seed: the same trace, row for row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from traces.hashing import Segment, TraceError, chain_segments
from traces.schema import Trace, TraceMeta, add_row, empty_columns, make_trace


@dataclass(frozen=True)
class AgenticSpec:
    sessions: int = 50
    """Number of sessions."""
    seed: int = 0
    """Seed of every random draw."""
    session_rate: float = 1.0
    """Session arrivals per second (Poisson)."""
    system_prompts: int = 3
    """Distinct shared system prompts."""
    system_tokens: int = 1024
    """Tokens of each system prompt."""
    repositories: int = 8
    """Distinct shared repository contexts."""
    repo_tokens: tuple[int, int] = (512, 4096)
    """Range of a repository context's tokens (uniform)."""
    user_tokens: tuple[int, int] = (32, 256)
    """Range of the first user message's tokens."""
    turns_mean: float = 6.0
    """Mean turns per session (geometric, at least 1)."""
    output_tokens: tuple[int, int] = (16, 256)
    """Range of an answer's tokens."""
    tool_tokens_median: float = 300.0
    """Median tokens of a tool result (lognormal, sigma 1)."""
    gap_s_median: float = 2.0
    """Median tool time between an answer and the next turn, seconds (lognormal, sigma 0.8)."""
    max_input_tokens: int = 32768
    """A session ends before a prompt would pass this."""
    block_tokens: int = 16
    """Base block size of the hashes."""
    nominal_ttft_s: float = 0.5
    """Assumed time to first token, for the open-loop arrival times of later turns."""
    nominal_tpot_s: float = 0.02
    """Assumed time per output token, likewise."""

    def check(self) -> None:
        if self.sessions <= 0 or self.session_rate <= 0 or self.turns_mean < 1:
            raise TraceError("sessions and session_rate must be positive, turns_mean at least 1")
        if self.system_prompts <= 0 or self.repositories <= 0 or self.block_tokens <= 0:
            raise TraceError("system_prompts, repositories and block_tokens must be positive")
        for name in ("repo_tokens", "user_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise TraceError(f"{name} must be a range 0 < lo <= hi, got {(lo, hi)}")


def _zipf_weights(n: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1)
    out: np.ndarray = w / w.sum()
    return out


def synth_agentic(spec: AgenticSpec) -> Trace:
    spec.check()
    rng = np.random.default_rng(spec.seed)
    repo_len = rng.integers(spec.repo_tokens[0], spec.repo_tokens[1] + 1, size=spec.repositories)
    starts = np.cumsum(rng.exponential(1.0 / spec.session_rate, size=spec.sessions))
    starts -= starts[0]
    cols = empty_columns()
    for s in range(spec.sessions):
        sysp = int(rng.choice(spec.system_prompts, p=_zipf_weights(spec.system_prompts)))
        repo = int(rng.choice(spec.repositories, p=_zipf_weights(spec.repositories)))
        turns = int(rng.geometric(1.0 / spec.turns_mean))
        segments: list[Segment] = [
            (f"sys{sysp}", spec.system_tokens),
            (f"repo{repo}", int(repo_len[repo])),
            (f"s{s}-user", int(rng.integers(spec.user_tokens[0], spec.user_tokens[1] + 1))),
        ]
        arrival = float(starts[s])
        gap: float | None = None
        parent: str | None = None
        for turn in range(turns):
            n_in = sum(n for _, n in segments)
            if n_in > spec.max_input_tokens:
                break
            n_out = int(rng.integers(spec.output_tokens[0], spec.output_tokens[1] + 1))
            rid = f"s{s}-t{turn}"
            add_row(
                cols,
                request_id=rid,
                session_id=f"s{s}",
                parent_request_id=parent,
                turn=turn,
                arrival_s=arrival,
                gap_s=gap,
                input_tokens=n_in,
                output_tokens=n_out,
                block_hashes=chain_segments(segments, spec.block_tokens),
            )
            tool = max(1, int(rng.lognormal(np.log(spec.tool_tokens_median), 1.0)))
            gap = float(rng.lognormal(np.log(spec.gap_s_median), 0.8))
            segments += [(f"{rid}-answer", n_out), (f"{rid}-tool", tool)]
            arrival += spec.nominal_ttft_s + spec.nominal_tpot_s * n_out + gap
            parent = rid
    if not cols["request_id"]:
        raise TraceError(
            f"no session fits max_input_tokens={spec.max_input_tokens}: a first prompt is at least "
            f"{spec.system_tokens + spec.repo_tokens[0] + spec.user_tokens[0]} tokens"
        )
    source = f"synth:agentic seed={spec.seed} sessions={spec.sessions}"
    notes = (
        f"arrival_s of later turns assumes {spec.nominal_ttft_s} s + {spec.nominal_tpot_s} s/token of service; "
        "gap_s is exact"
    )
    return make_trace(cols, TraceMeta(spec.block_tokens, source, notes))
