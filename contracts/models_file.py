"""The models file (TOML): served models, aliases, fallbacks and canaries. Its shape and its checks live
here, below both readers: the router's model table (``router.model_table``: what the entries mean per
request) and ``tandem up --models`` (``infra.launcher``: nodes for each ``[served]`` entry).

Checks (``ConfigError`` at start-up, naming the file and the entry): names are non-empty; an alias,
canary or served name is each at most one of those; aliases point at a served or canary name, never
at another alias; canaries have at least two served names with positive integer weights; a fallback
goes from a served name to another served name; with a ``[served]`` section every target must be one
of its names.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contracts.errors import ConfigError


class ServedModel(BaseModel):
    """One served model in the file: what ``tandem up --models`` starts nodes of (the router reads only
    the name)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = ""
    """Model folder; empty: the prepared default model (SmolLM2-135M-Instruct)."""
    dtype: str | None = None
    """Engine dtype of this model's nodes; None: the cluster's (``tandem up --dtype``)."""


class ModelsFile(BaseModel):
    """The file's shape (``router.model_table.ModelTable`` is what the router makes of it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served: dict[str, ServedModel] = Field(default_factory=dict)
    aliases: dict[str, str] = Field(default_factory=dict)
    fallbacks: dict[str, str] = Field(default_factory=dict)
    canaries: dict[str, dict[str, int]] = Field(default_factory=dict)


def read_models_file(path: Path) -> ModelsFile:
    """Parse and shape-check a models file (``ConfigError`` naming the file and the entry)."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"models file {path}: cannot read it: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"models file {path}: not valid TOML: {exc}") from exc
    try:
        return ModelsFile.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise ConfigError(f"models file {path}: {loc or 'file'}: {first.get('msg')}") from exc


def check_models(spec: ModelsFile, source: str) -> None:
    """The checks of the module docstring; ``ConfigError`` naming ``source`` and the entry."""

    def bad(msg: str) -> ConfigError:
        return ConfigError(f"{source}: {msg}")

    served, aliases, canaries = set(spec.served), set(spec.aliases), set(spec.canaries)
    for name in served | aliases | canaries | set(spec.fallbacks):
        if not name.strip():
            raise bad("a model name is empty")
    for a, b, what in ((aliases, canaries, "an alias and a canary"), (aliases | canaries, served, "served and public")):
        if a & b:
            raise bad(f"{', '.join(sorted(a & b))}: both {what} name")
    for name, weights in spec.canaries.items():
        if len(weights) < 2:
            raise bad(f"canaries.{name}: needs at least two served names, has {len(weights)}")
        for target, w in weights.items():
            if w <= 0:
                raise bad(f"canaries.{name}.{target}: weight {w} is not a positive integer")
            if target in aliases or target in canaries:
                raise bad(f"canaries.{name}.{target}: a canary splits between served names, not public ones")
    for alias, target in spec.aliases.items():
        if target in aliases:
            raise bad(f"aliases.{alias}: points at another alias ({target}); name its target instead")
    for model, fallback in spec.fallbacks.items():
        if model == fallback:
            raise bad(f"fallbacks.{model}: a model cannot be its own fallback")
        if model in aliases or model in canaries or fallback in aliases or fallback in canaries:
            raise bad(f"fallbacks.{model}: fallbacks go from a served name to a served name")
    if served:
        targets = [(f"aliases.{a}", t) for a, t in spec.aliases.items() if t not in canaries]
        targets += [(f"canaries.{c}", t) for c, w in spec.canaries.items() for t in w]
        targets += [(f"fallbacks.{m}", m) for m in spec.fallbacks] + [
            (f"fallbacks.{m}", f) for m, f in spec.fallbacks.items()
        ]
        for where, target in targets:
            if target not in served:
                raise bad(f"{where}: {target!r} is not a served model ({', '.join(sorted(served))})")
