"""The routing-policy interface. Policies know nothing about HTTP, Redis or engines.

A policy receives the request's routing view and the live candidates of each role, and returns a
``Decision``. The router calls ``on_complete`` when the request ends so that policies keeping their
own state (round-robin cursors, in-flight counts) can settle it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from contracts.registry import LiveNode


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a policy may look at. Token ids and block keys are filled by the router when known."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...] = ()
    session_id: str | None = None
    block_keys: tuple[int, ...] = ()
    """Routing keys of the prompt's full blocks (``router.kv_index.BlockHasher.keys``, the model's
    block size, hash algo and seed); empty when unknown. Read by ``cache_aware``."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A live node plus the router's own view of it (requests this router has in flight there)."""

    node: LiveNode
    inflight: int = 0

    @property
    def node_id(self) -> str:
        return self.node.info.node_id


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes. ``prefill is None`` means no transfer: ``decode`` prefills itself."""

    decode: Candidate
    prefill: Candidate | None
    policy: str
    reason: str
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


class RoutingPolicy(Protocol):
    name: str

    def select(
        self,
        request: RoutingRequest,
        prefill: list[Candidate],
        decode: list[Candidate],
    ) -> Decision:
        """Pick a node pair. ``prefill`` may be empty (colocated mode); ``decode`` is never empty."""
        ...

    def on_complete(self, decision: Decision) -> None: ...
