"""SIMULATOR: how long an engine step and a KV transfer take, per node kind.

A step (one pass of vLLM's continuous batching) costs

    base_s + prefill_s_per_token * uncached prompt tokens computed in it
           + prefill_s_per_ctx_pair * (token computed, token already in the KV cache) pairs
           + prefill_s_per_new_pair * (token computed, earlier token computed in the same step) pairs
           + decode_s_per_seq * requests decoding a token in it
           + decode_s_per_ctx_token * context tokens those requests attend over
           + decode_s_per_kv_token * distinct KV tokens held while they decode

(the form llm-d's BLIS and Vidur fit, with the context terms that attention adds: a chunk of k new
tokens after c computed ones, a cached prefix or earlier chunks, attends over k * c pairs of the first
kind and k * k / 2 of the second, so a short turn after a long cached history costs more than the same
tokens alone; the two are apart because the engine's attention over cached blocks and over the step's
own tokens are different kernels, and measured here they cost different amounts; and a decode's
attention costs arithmetic per stream and context token, but reads each KV block once a step however
many streams share it: 16 streams on one 2.3k-token prefix decode nearly as fast as on a 256-token
one, while 8 streams of distinct 1k prompts are a third slower than of 256-token ones, so the reads
are a term of their own, over the node's distinct KV tokens), and a transfer
``transfer_base_s + bytes / transfer_bytes_per_s``; a request also pays ``request_overhead_s`` once,
before its first node queues it (HTTP and the router: not step time). ``tandem profile`` measures a real engine and fits
these by least squares (``profiling/``); a ``Profile`` holds one ``StepModel`` per node kind
(``both``, ``prefill``, ``decode``: on a shared machine a node runs slower when another engine shares its
cores, so the kinds are measured the way they run) and is stored as JSON. ``StepModel()`` without a
profile carries PLACEHOLDER coefficients and says so (``source``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from contracts.registry import Role

PROFILE_VERSION = 1


@dataclass(frozen=True)
class StepModel:
    base_s: float = 0.004
    """Fixed cost of a step."""
    prefill_s_per_token: float = 0.0002
    """Per uncached prompt token computed in the step."""
    prefill_s_per_ctx_pair: float = 0.0
    """Per (prompt token computed in the step, token of its prompt already in the KV cache) pair."""
    prefill_s_per_new_pair: float = 0.0
    """Per (prompt token computed in the step, earlier token of its prompt computed in the same step) pair."""
    decode_s_per_seq: float = 0.001
    """Per running request decoding a token in the step."""
    decode_s_per_ctx_token: float = 0.0
    """Per context token (prompt + generated so far) of the requests decoding in the step."""
    decode_s_per_kv_token: float = 0.0
    """Per distinct KV token held on the node in a step that decodes (a block several requests share
    counts once): the attention's reads of the cache."""
    request_overhead_s: float = 0.0
    """Per request, outside any step: from the client's send until the engine can schedule it, plus
    the first token's way back (HTTP, the engine's API server, and the router when one is in front).
    A request reaches its first node's queue this long after it arrives."""
    kv_bytes_per_token: int = 23_040
    """KV bytes per token (SmolLM2-135M, bf16)."""
    transfer_base_s: float = 0.002
    """Fixed cost of a KV transfer: with a measured profile, the whole handover from the prefill
    leg's last step to the decode node's queue (the prefill answer's way back, the router opening
    the decode leg, the pull's fixed cost)."""
    transfer_bytes_per_s: float = 2e9
    """KV transfer bandwidth."""
    shared_slowdown: float = 1.0
    """How many times longer a step takes while another node of the same host is mid-step (nodes
    whose ``NodeSpec.host`` is the same): engines pinned to cores of their own still share the
    memory bus and caches, and a decode step, which reads every weight once, runs slower beside a
    busy neighbour. ``profiling.measure.neighbour_slowdown`` measured 1.08-1.65x a decode step and
    0.94-1.04x a prefill on a shared 2-core host, within its noise, so ``tandem bench sim``
    keeps 1.0 (nothing shared) there."""
    source: str = "PLACEHOLDER (not measured)"
    """Where the coefficients come from (a profile's description, or PLACEHOLDER)."""

    def step_s(
        self,
        prefill_tokens: int,
        decode_batch: int,
        context_tokens: int = 0,
        ctx_pairs: float = 0.0,
        new_pairs: float = 0.0,
        kv_tokens: float = 0.0,
    ) -> float:
        return (
            self.base_s
            + self.decode_s_per_kv_token * kv_tokens
            + self.prefill_s_per_token * prefill_tokens
            + self.prefill_s_per_ctx_pair * ctx_pairs
            + self.prefill_s_per_new_pair * new_pairs
            + self.decode_s_per_seq * decode_batch
            + self.decode_s_per_ctx_token * context_tokens
        )

    def slowdown(self, busy_neighbours: int) -> float:
        """A step's time multiplier with ``busy_neighbours`` other nodes of its host mid-step (linear in
        them: only one neighbour has been measured)."""
        return 1.0 + (self.shared_slowdown - 1.0) * busy_neighbours

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_base_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s


@dataclass(frozen=True)
class Profile:
    """Step models per node kind, as ``tandem profile`` writes them (``--profile FILE``)."""

    models: dict[Role, StepModel]
    """At least one kind; a kind without its own model uses ``both``'s, else any (``for_role``)."""
    description: str = ""
    measurements: dict[str, object] = field(default_factory=dict)
    """The raw points the fit came from and its residuals (kept for the record, not read back)."""

    def for_role(self, role: Role) -> StepModel:
        if role in self.models:
            return self.models[role]
        if Role.BOTH in self.models:
            return self.models[Role.BOTH]
        return next(iter(self.models.values()))

    def to_json(self) -> str:
        return json.dumps(
            {
                "profile_version": PROFILE_VERSION,
                "description": self.description,
                "models": {role.value: asdict(m) for role, m in self.models.items()},
                "measurements": self.measurements,
            },
            indent=1,
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable profile ({exc})") from exc
        if d.get("profile_version") != PROFILE_VERSION:
            raise ValueError(f"{path}: profile version {d.get('profile_version')!r}, expected {PROFILE_VERSION}")
        names = {f.name for f in fields(StepModel)}
        models = {Role(k): StepModel(**{n: v for n, v in m.items() if n in names}) for k, m in d["models"].items()}
        if not models:
            raise ValueError(f"{path}: a profile needs at least one step model")
        return cls(models=models, description=d.get("description", ""), measurements=d.get("measurements", {}))


def placeholder_profile() -> Profile:
    return Profile(models={Role.BOTH: StepModel()}, description="PLACEHOLDER (not measured)")
