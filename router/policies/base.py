"""The routing-policy interface. Policies know nothing about HTTP, Redis or engines.

A policy receives the request's routing view and the live candidates of each role, and returns a
``Decision``: the nodes, a reason code (``ReasonCode``) with the figures its rule compared
(``threshold``, ``load``), and a sentence for people (``reason``, display only: the lake, the
report and ``usage.tandem`` group and filter by the code). The router calls ``on_prefilled`` when a
streamed answer's first token reaches it (the node that prefilled has no prompt work left for it) and
``on_complete`` when the request ends, whatever happened before (a request that fails or is answered
whole gets ``on_complete`` alone), so that policies keeping their own state (round-robin cursors,
in-flight counts, queued prompt tokens) can settle it.
"""

from __future__ import annotations

import enum
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


class PolicyName(enum.StrEnum):
    """The routing policies, one module each: the router's ``policy`` setting (``TANDEM_ROUTER_POLICY``),
    each policy's ``name``, the benchmarks' arms and the Helm chart's enum all come from here."""

    CACHE_AWARE = "cache_aware"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


class ReasonCode(enum.StrEnum):
    """Why a policy chose a node. ``Decision.code`` is the rule that chose the node that prefills (whose
    cache decides the hit), ``Decision.decode_code`` the one that chose the decode node. Per code, what
    ``Decision.threshold`` and ``Decision.load`` hold (None where the rule compares nothing):

        best_prefix        the node with the best cached - load_weight * queued score (cache_aware);
                           threshold None, load = the node's load (requests in flight + waiting)
        load_guard         the pool's load spread exceeded the guard, so the least loaded node won and
                           the cache was ignored; threshold = imbalance_threshold, load = the spread
        session_affinity   the session's previous node, within the guard; threshold =
                           imbalance_threshold, load = the node's load
        local_prefill      the decode node prefills itself: few tokens were left to compute there;
                           threshold = local_prefill_max_tokens, load = the decode node's load
        prefill_saturated  the decode node prefills itself: every prefill node was at or above
                           prefill_saturation_load (threshold), load = the least prefill load
        most_cached        (decode) the decode node holding most of the prompt, within the guard
        least_busy         (decode) the decode node with the lowest running + waiting + kv cost
        least_loaded       the least_loaded policy; load = the node's load
        round_robin        the round_robin policy's turn
        forced_pd          the client's ``x-tandem-route: disaggregated`` overrode a local prefill
        pinned             an operator's ``x-tandem-node`` named the node, which serves the request alone
                           (no policy was asked; the request never moves to another node)
    """

    BEST_PREFIX = "best_prefix"
    LOAD_GUARD = "load_guard"
    SESSION_AFFINITY = "session_affinity"
    LOCAL_PREFILL = "local_prefill"
    PREFILL_SATURATED = "prefill_saturated"
    MOST_CACHED = "most_cached"
    LEAST_BUSY = "least_busy"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"
    FORCED_PD = "forced_pd"
    PINNED = "pinned"


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes. ``prefill is None`` means no transfer: ``decode`` prefills itself."""

    decode: Candidate
    prefill: Candidate | None
    policy: str
    code: ReasonCode
    """The rule that chose the node that prefills (``prefill``, else ``decode``)."""
    decode_code: ReasonCode
    """The rule that chose the decode node (equal to ``code`` when one node does both)."""
    reason: str = ""
    """The decision in a sentence, for people (logs, ``usage.tandem.reason``); never parsed."""
    threshold: float | None = None
    """The threshold ``code``'s rule compared against (see ``ReasonCode``)."""
    load: float | None = None
    """The load figure ``code``'s rule compared (see ``ReasonCode``)."""
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

    def on_prefilled(self, decision: Decision) -> None:
        """The decision's first token reached the router (at most once, before ``on_complete``)."""
        ...

    def on_complete(self, decision: Decision) -> None:
        """The decision's request ended (exactly once per decision the router acted on)."""
        ...

    def on_split(self, decision: Decision, helper: str, prefix_tokens: int) -> None:
        """The decision's prompt is split (``router.planning.split_prefill``): ``helper`` computes its first
        ``prefix_tokens`` (at most once, before ``on_prefilled``)."""
        ...
