"""SIMULATOR: how long an engine step and a KV transfer take, per node kind.

A step (one pass of vLLM's continuous batching) costs

    base_s + prefill_s_per_token * uncached prompt tokens computed in it
           + decode_s_per_seq * requests decoding a token in it
           + decode_s_per_ctx_token * context tokens those requests attend over

(the form llm-d's BLIS and Vidur fit, with the context term that attention adds), and a transfer
``transfer_base_s + bytes / transfer_bytes_per_s``. ``tandem profile`` measures a real engine and fits
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
    decode_s_per_seq: float = 0.001
    """Per running request decoding a token in the step."""
    decode_s_per_ctx_token: float = 0.0
    """Per context token (prompt + generated so far) of the requests decoding in the step."""
    kv_bytes_per_token: int = 23_040
    """KV bytes per token (SmolLM2-135M, bf16)."""
    transfer_base_s: float = 0.002
    """Fixed cost of a KV transfer."""
    transfer_bytes_per_s: float = 2e9
    """KV transfer bandwidth."""
    source: str = "PLACEHOLDER (not measured)"
    """Where the coefficients come from (a profile's description, or PLACEHOLDER)."""

    def step_s(self, prefill_tokens: int, decode_batch: int, context_tokens: int = 0) -> float:
        return (
            self.base_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decode_batch
            + self.decode_s_per_ctx_token * context_tokens
        )

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
