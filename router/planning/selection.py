"""Where a request goes: the pool choice around the routing policy, the operator's pin, the retry's node.

The policies (``router.policies``) pick a node within the pools they are given; this module decides
which pools they are given, from what is live and what the client asked (``x-tandem-route``):

    prefill and decode pools live, not forced colocated  ─▶ policy over (prefill, decode)
                                                            (forced P/D: a prefill node is added
                                                             when the policy chose a local prefill)
    else colocated nodes ─▶ else decode nodes ─▶ else prefill nodes   (each serves a request alone)
    none                 ─▶ 503

No I/O: every function takes the fleet's snapshot (``router.fleet.Pools``) and returns a choice, so
routing is testable without sockets (``tests/simulator/test_routing.py`` replays the simulator's
decisions through ``select``).
"""

from __future__ import annotations

from dataclasses import replace

from contracts.errors import TandemError, Unavailable
from router.fleet import Fleet, Pools
from router.policies.base import Candidate, Decision, ReasonCode, RoutingPolicy, RoutingRequest
from router.policies.least_loaded import LeastLoaded
from router.record.trace import RouteMode

PIN_HEADER = "x-tandem-node"


def select(
    policy: RoutingPolicy, rr: RoutingRequest, pools: Pools, prefer: RouteMode | None, retry_after: float
) -> Decision:
    """The policy's decision over the pools that can serve ``rr`` (see the module docstring)."""
    pd_ok = bool(pools.prefill and pools.decode)
    if prefer != "colocated" and pd_ok:
        decision = policy.select(rr, pools.prefill, pools.decode)
        if prefer == "disaggregated" and decision.prefill is None:
            # The policy chose a local prefill; the client asked for the P/D path explicitly.
            prefill = LeastLoaded().select(rr, pools.prefill, [decision.decode]).prefill
            reason = f"{decision.reason}; P/D forced by header"
            decision = replace(decision, prefill=prefill, code=ReasonCode.FORCED_PD, reason=reason)
        return decision
    if pools.colocated:
        return policy.select(rr, [], pools.colocated)
    if pools.decode:  # decode nodes can prefill for themselves; slower, but serves
        return policy.select(rr, [], pools.decode)
    if pools.prefill:
        # Every decode node is gone (a crash, a restart): a prefill engine runs the whole request
        # itself (its connector is kv_both, and with no kv_transfer_params it is a plain engine).
        return policy.select(rr, [], pools.prefill)
    live = "no node of it is live"
    raise Unavailable(f"no node can serve `{rr.model}` now ({live})", retry_after=retry_after)


def pinned(fleet: Fleet, policy: RoutingPolicy, model: str, node_id: str, retry_after: float) -> Decision:
    """The operator's choice (``x-tandem-node``): that node alone, whatever the policy would pick."""
    node = fleet.pinned(model, node_id, param=PIN_HEADER, retry_after=retry_after)
    code = ReasonCode.PINNED
    return Decision(node, None, policy.name, code, code, reason=f"pinned to {node_id} by {PIN_HEADER}")


def has_choice(tokenize: str, pools: Pools) -> bool:
    """Whether routing has a choice to make that the prompt's tokens inform (``tokenize`` setting):
    more than one node could take part. With one node the router would render and encode every
    prompt (about 1 ms of CPU per 512 tokens, the largest part of its per-request cost) for a
    decision it does not have."""
    if tokenize == "always":
        return True
    return len(pools.prefill) + len(pools.decode) + len(pools.colocated) > 1


def another_node(fleet: Fleet, model: str, failed: str) -> Candidate | None:
    """The least busy node other than ``failed`` that serves ``model`` alone: colocated, else decode,
    else prefill (a prefill engine serves whole requests when no decode node is left)."""
    try:
        pools = fleet.pools(model, exclude=frozenset({failed}))
    except TandemError:
        return None
    for pool in (pools.colocated, pools.decode, pools.prefill):
        # Not one that failed a leg moments ago (``pools`` still lists down nodes when all are down).
        options = [c for c in pool if c.node_id != failed and not fleet.is_down(c.node_id)]
        if options:
            return min(options, key=lambda c: c.inflight)
    return None
