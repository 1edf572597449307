"""The model table: which served model a request's ``model`` names, resolved once per request before routing.

Names
    served name   what a node's engine serves (``--served-model-name``, as in the registry)
    alias         another public name for one served name (or for a canary)
    canary        one public name split between two or more served names by integer weights

Resolution of a request's ``model`` (``ModelTable.resolve``), in this order:

    1. an alias is replaced by its target                                      via = alias
    2. a canary name picks one of its served names by weight                   via = canary
       (smooth weighted round robin, as nginx's upstreams: with weights 90/10 every 100 picks are
       exactly 90 and 10, interleaved; no randomness, so a test can count it)
    3. a served name with no live node, whose fallback has one, becomes the
       fallback                                                                via = fallback
    4. otherwise the name is what it names                                     via = direct (or 1./2.)

A name the table does not know is passed through unchanged: the fleet then routes it if a node serves
it, else the usual 404 ``model_not_found``. A fallback is one hop (a fallback's own fallback is not
followed) and is also used when the node chosen for the model refuses for capacity
(``Orchestrator.plan``: its admission queue was full, ``overloaded``/``shed``); a request moves at
most once.

The file (TOML, ``TANDEM_ROUTER_MODELS``; its shape and checks are ``contracts.models_file``, shared
with ``tandem up --models``, which starts nodes for its ``[served]`` part)::

    [served.smollm]                 # optional here; tandem up starts nodes for each entry
    path = ""                       # model folder; empty: the prepared default model
    dtype = "float32"
    [served.smollm-bf16]
    dtype = "bfloat16"

    [aliases]
    small = "smollm"                # alias -> served name or canary name

    [fallbacks]
    smollm-bf16 = "smollm"          # served name -> served name

    [canaries.coder]                # public name -> {served name: weight}
    smollm = 90
    smollm-bf16 = 10

The checks on the file (``ConfigError`` at start-up) are in ``contracts.models_file``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from contracts.models_file import ModelsFile, check_models, read_models_file


class Via(enum.StrEnum):
    """How a request's model was resolved (the lake's ``model_resolution``, a metrics label)."""

    DIRECT = "direct"
    ALIAS = "alias"
    CANARY = "canary"
    FALLBACK = "fallback"


@dataclass(frozen=True, slots=True)
class Resolution:
    """One request's model, resolved."""

    requested: str
    """The client's ``model``."""
    served: str
    """The served name the request is routed to (and sent to the engine as ``model``)."""
    via: Via
    fallback: str | None
    """Where the request may still go if the node chosen for ``served`` refuses for capacity (None: nowhere)."""


class _Canary:
    """Smooth weighted round robin over one canary's served names: each pick adds every weight to its
    running score, takes the highest (ties: file order) and subtracts the total from it."""

    def __init__(self, weights: Mapping[str, int]) -> None:
        self.weights = dict(weights)
        self.total = sum(self.weights.values())
        self._score = dict.fromkeys(self.weights, 0)

    def pick(self) -> str:
        for name, w in self.weights.items():
            self._score[name] += w
        best = max(self._score, key=lambda n: self._score[n])
        self._score[best] -= self.total
        return best


class ModelTable:
    """Aliases, fallbacks and canaries (see the module docstring); an empty table resolves every name
    to itself."""

    def __init__(self, spec: ModelsFile | None = None, *, source: str = "the model table") -> None:
        spec = spec or ModelsFile()
        check_models(spec, source)
        self.spec = spec
        self.aliases = dict(spec.aliases)
        self.fallbacks = dict(spec.fallbacks)
        self._canaries = {name: _Canary(w) for name, w in spec.canaries.items()}

    @classmethod
    def load(cls, path: Path | None) -> ModelTable:
        """The table in ``path`` (TOML); None: the empty table."""
        if path is None:
            return cls()
        return cls(read_models_file(path), source=str(path))

    @property
    def public_names(self) -> list[str]:
        """Alias and canary names, in file order."""
        return [*self.aliases, *self._canaries]

    def parent(self, public: str) -> str:
        """What a public name stands for, as ``/v1/models`` shows it: an alias's target, a canary's
        heaviest served name (its stable version; ties: file order)."""
        if public in self.aliases:
            return self.aliases[public]
        weights = self._canaries[public].weights
        return max(weights, key=lambda n: weights[n])

    def targets(self, name: str) -> list[str]:
        """The served names ``name`` can resolve to before any fallback (itself when not in the table)."""
        name = self.aliases.get(name, name)
        canary = self._canaries.get(name)
        return list(canary.weights) if canary else [name]

    def known(self, name: str) -> bool:
        """Whether the file names ``name`` anywhere (served, alias or its target, canary or its versions,
        fallback): a bounded set, safe as a metrics label."""
        return (
            name in self.spec.served
            or name in self.aliases
            or name in self.aliases.values()
            or name in self._canaries
            or name in self.fallbacks
            or name in self.fallbacks.values()
            or any(name in c.weights for c in self._canaries.values())
        )

    def resolve(self, requested: str, is_live: Callable[[str], bool]) -> Resolution:
        """Resolve a request's ``model``; ``is_live(served)`` says whether a node of it can serve now."""
        name, via = requested, Via.DIRECT
        if name in self.aliases:
            name, via = self.aliases[name], Via.ALIAS
        canary = self._canaries.get(name)
        if canary is not None:
            name, via = canary.pick(), Via.CANARY
        fallback = self.fallbacks.get(name)
        if fallback is not None and not is_live(name) and is_live(fallback):
            return Resolution(requested, fallback, Via.FALLBACK, None)
        return Resolution(requested, name, via, fallback)
