"""Miss attribution: why each prompt token the engine computed was not reused.

At routing time the router reads the fleet index once for the prompt's block keys (``prefix_view``):

    fleet    the longest prefix any node holds             (``fleet_cached_tokens``)
    routed   the prefix the node chosen to prefill holds   (``routed_cached_tokens``): its engine's own
             blocks, then those its host tier holds after them (``routed_tier``, what its
             ``HostTierConnector`` will load; ``router.kv_index.index``)
    seen     the longest prefix the fleet has held at all: held now by some node, or in the index's
             bounded eviction history (``ModelIndex.evicted``), with the eviction that broke it
    all capped, like vLLM's own reuse, at (P - 1) // block_size whole blocks (P = prompt tokens): the
    block holding the last prompt token is always computed.

When the engine has said what it reused (``engine_cached_tokens``, E), ``attribute`` splits the
uncached tokens U = P - E along the prompt, each token into the first kind whose boundary it passes:

    [0, E)                      reused (a hit)
    [E, max(E, routed))         undelivered: the index said the routed node held it, the engine did
                                not reuse it (index lag, an eviction the router had not seen yet, a
                                key mismatch)
    [.., max(.., fleet))        elsewhere: another node held it; ``elsewhere_node`` is that node and
                                ``elsewhere_reason`` why the request went where it did not: the
                                decision's reason code (load_guard, best_prefix when the queue
                                outweighed the cache, local_prefill, round_robin, ...), or node_down
                                when the holder was not a live candidate at all
    [.., max(.., seen))         evicted: the fleet had held it and let it go; ``evicted_node``,
                                ``evicted_tier`` (the event's medium, or cleared / events_lost /
                                node_left) and ``evicted_ago_s`` describe the eviction that broke it
    [.., P)                     cold: never in the fleet (within the history's reach), the last
                                block included

The reused tokens E split by where they came from (``usage.tandem.kv_origin``, the lake's
``local_cached_tokens`` / ``peer_cached_tokens`` / ``host_tier_cached_tokens``): the engine looks in
its own cache first, then loads from a peer (``router.planning.peer_fetch``: the prefix the peer leased) or
else its host tier, so the peer's and the tier's shares are what they were to add beyond the engine's
own prefix, as far as E reaches there; the rest of E is the engine's own. vLLM reports only
the sum (its count includes what a connector loaded), so this split is the index's, checked against
the engine's total: reuse beyond the prediction (index lag) counts as the engine's own, a predicted
tier hit the engine did not take shows as undelivered.

so cold + evicted + elsewhere + undelivered = U exactly, for every request with both figures. No
figure is attributed when the router did not hash the prompt (one node and no token limits: see
``router.planning.orchestrator``) or the engine never reported its reuse (the request failed before).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from router.kv_index.block_keys import BlockKey
from router.kv_index.index import FleetIndex


@dataclass(frozen=True, slots=True)
class PrefixView:
    """What the fleet index said about one prompt when it was routed (token counts)."""

    prompt_tokens: int
    fleet_tokens: int
    routed_tokens: int
    seen_tokens: int
    routed_tier_tokens: int = 0
    """The part of ``routed_tokens`` the routed node's host tier holds (after the engine's own)."""
    routed_peer_tokens: int = 0
    """The part of ``routed_tokens`` the routed node loads from a peer (after its engine's own,
    ``router.planning.peer_fetch``); set once the peer leased them, when the tier's part is 0 (the peer's covers it)."""
    elsewhere_node: str | None = None
    """The node holding the fleet's longest prefix, when that is longer than the routed node's."""
    elsewhere_reason: str | None = None
    evicted_node: str | None = None
    evicted_tier: str | None = None
    evicted_ago_s: float | None = None


def prefix_view(
    index: FleetIndex,
    model: str,
    keys: Sequence[BlockKey],
    *,
    prompt_tokens: int,
    block_size: int,
    routed_node: str,
    live_nodes: Collection[str],
    reason_code: str | None,
    now: float,
) -> PrefixView:
    """Read the index for one prompt: ``routed_node`` prefills it, ``live_nodes`` are the candidates the
    policy was offered, ``reason_code`` why it chose as it did."""
    cap = max((prompt_tokens - 1) // block_size, 0) if block_size > 0 else 0
    keys = keys[:cap]
    matches = index.longest_prefix(model, keys)
    fleet_blocks = max(matches.values(), default=0)
    routed_blocks = matches.get(routed_node, 0)
    tier_blocks = index.split(model, keys, routed_node)[1] if routed_blocks else 0
    elsewhere = reason = None
    if fleet_blocks > routed_blocks:
        elsewhere = min((n for n, b in matches.items() if b == fleet_blocks), key=lambda n: (n not in live_nodes, n))
        reason = reason_code if elsewhere in live_nodes else "node_down"
    seen_blocks, ev = fleet_blocks, None
    idx = index.get(model)
    if idx is not None:
        seen_blocks, ev = idx.history_prefix(keys, fleet_blocks)
    return PrefixView(
        prompt_tokens=prompt_tokens,
        fleet_tokens=fleet_blocks * block_size,
        routed_tokens=routed_blocks * block_size,
        seen_tokens=seen_blocks * block_size,
        routed_tier_tokens=tier_blocks * block_size,
        elsewhere_node=elsewhere,
        elsewhere_reason=reason,
        evicted_node=ev.node_id if ev else None,
        evicted_tier=ev.cause if ev else None,
        evicted_ago_s=max(now - ev.at, 0.0) if ev else None,
    )


@dataclass(frozen=True, slots=True)
class MissAttribution:
    """The uncached tokens of one request, by kind (they sum to ``uncached``)."""

    uncached: int
    cold: int
    evicted: int
    elsewhere: int
    undelivered: int
    evicted_node: str | None = None
    evicted_tier: str | None = None
    evicted_ago_s: float | None = None
    elsewhere_node: str | None = None
    elsewhere_reason: str | None = None
    local_hit: int = 0
    """Reused tokens from the prefilling engine's own cache."""
    peer_hit: int = 0
    """Reused tokens loaded from a peer node's engine (``router.planning.peer_fetch``)."""
    host_tier_hit: int = 0
    """Reused tokens its host tier supplied."""

    def origin(self) -> dict[str, int]:
        """As ``usage.tandem.kv_origin``: where every prompt token came from (they sum to the prompt)."""
        return {
            "engine": self.local_hit,
            "host_tier": self.host_tier_hit,
            "peer": self.peer_hit,
            "computed": self.uncached,
        }

    def usage(self) -> dict[str, Any]:
        """As ``usage.tandem.miss``."""
        return {
            "cold": self.cold,
            "evicted": self.evicted,
            "elsewhere": self.elsewhere,
            "undelivered": self.undelivered,
            "evicted_node": self.evicted_node,
            "evicted_tier": self.evicted_tier,
            "evicted_ago_s": self.evicted_ago_s,
            "elsewhere_node": self.elsewhere_node,
            "elsewhere_reason": self.elsewhere_reason,
        }

    def record(self) -> dict[str, Any]:
        """As the lake's ``requests`` columns (``miss_*``)."""
        return {
            "uncached_tokens": self.uncached,
            "miss_cold_tokens": self.cold,
            "miss_evicted_tokens": self.evicted,
            "miss_elsewhere_tokens": self.elsewhere,
            "miss_undelivered_tokens": self.undelivered,
            "miss_evicted_node": self.evicted_node,
            "miss_evicted_tier": self.evicted_tier,
            "miss_evicted_ago_s": self.evicted_ago_s,
            "miss_elsewhere_node": self.elsewhere_node,
            "miss_elsewhere_reason": self.elsewhere_reason,
            "local_cached_tokens": self.local_hit,
            "host_tier_cached_tokens": self.host_tier_hit,
            "peer_cached_tokens": self.peer_hit,
        }


def attribute(view: PrefixView, engine_cached: int) -> MissAttribution:
    """Split ``view.prompt_tokens - engine_cached`` into the four kinds (see the module docstring)."""
    p = view.prompt_tokens
    e = min(max(engine_cached, 0), p)
    b_undelivered = max(e, min(view.routed_tokens, p))
    b_elsewhere = max(b_undelivered, min(view.fleet_tokens, p))
    b_evicted = max(b_elsewhere, min(view.seen_tokens, p))
    elsewhere = b_elsewhere - b_undelivered
    evicted = b_evicted - b_elsewhere
    own = view.routed_tokens - view.routed_tier_tokens - view.routed_peer_tokens
    past_own = e - min(e, own)  # what the engine reused beyond its own prefix: the peer's, then the tier's
    peer = min(view.routed_peer_tokens, past_own)
    tier = min(view.routed_tier_tokens, past_own - peer)
    return MissAttribution(
        uncached=p - e,
        cold=p - b_evicted,
        evicted=evicted,
        elsewhere=elsewhere,
        undelivered=b_undelivered - e,
        evicted_node=view.evicted_node if evicted else None,
        evicted_tier=view.evicted_tier if evicted else None,
        evicted_ago_s=view.evicted_ago_s if evicted else None,
        elsewhere_node=view.elsewhere_node if elsewhere else None,
        elsewhere_reason=view.elsewhere_reason if elsewhere else None,
        local_hit=e - tier - peer,
        host_tier_hit=tier,
        peer_hit=peer,
    )
