"""SIMULATOR: the router of the simulated fleet, the real policy objects given what the real router gives
them.

The real policy (``router.policies``, built by ``make_policy``) is given what the real
router gives it. Candidates are ``router.policies.Candidate`` of ``LiveNode`` records whose
``NodeLoad`` (running, waiting, KV usage) is refreshed every ``heartbeat_s`` simulated seconds (the
real router re-reads the registry each second), plus the router's own in-flight count per node
(as ``router.fleet.Fleet.track``: on the prefill node during the prefill leg, on the decode node
until the answer ends); the pool choice is ``Orchestrator._select``'s (P/D when both pools
exist, else colocated, else decode: ``select_pools``, checked equal to the real one by a test);
``on_prefilled`` is called at the first token (the router calls it when a stream's first event
arrives) and ``on_complete`` when the request ends. The prefix lookup (``SimLookup``) reads a
fleet-wide map of which node holds which key, kept by the pools as they store and evict, a
prompt's blocks entering it at the end of the step that computed them (vLLM publishes its KV events
after a step: a request routed while a shared prefix is still being computed does not see it there,
and in a recorded real run the router sent such a request to the other node): what the
router's ``FleetIndex`` would hold with every KV event applied (a test feeds the real index the
simulator's events and gets the same decisions).
Here: candidates (one list per role, a node's slot fixed) rebuilt only when a node's in-flight count or
its heartbeat changes; ``route`` counts the new request in flight where it goes (the prefill node until
its prefill leg ends, the decode node until the answer ends: ``FleetSim`` calls ``track`` back).
"""

from __future__ import annotations

from collections.abc import Sequence

from contracts.registry import Role
from router.fleet import Pools
from router.policies import Candidate, Decision, RoutingPolicy, RoutingRequest
from simulator.sim_nodes import SimNode, SimRequest

__all__ = ["LogEntry", "SimRouter", "select_pools"]

LogEntry = tuple[str, object]
"""("route", (RoutingRequest, Pools, Decision)) | ("done", Decision) | ("kv", (node_id, "stored"|"removed", key))."""


def select_pools(policy: RoutingPolicy, rr: RoutingRequest, pools: Pools) -> Decision:
    """The pool choice of ``router.planning.orchestrator.Orchestrator._select`` with no client preference."""
    if pools.prefill and pools.decode:
        return policy.select(rr, pools.prefill, pools.decode)
    if pools.colocated:
        return policy.select(rr, [], pools.colocated)
    if pools.decode:
        return policy.select(rr, [], pools.decode)
    raise ValueError("no decode or colocated node in the simulated fleet")


class SimRouter:
    """Routes simulated requests with ``policy`` over ``nodes`` (their ``slot`` set here); ``log``, when
    given, records every decision with copies of the pools the policy saw."""

    def __init__(self, nodes: Sequence[SimNode], policy: RoutingPolicy, model: str, log: list[LogEntry] | None) -> None:
        self.policy = policy
        self.model = model
        self.log = log
        self.inflight: dict[str, int] = {}
        self.lists: dict[Role, list[Candidate]] = {Role.PREFILL: [], Role.DECODE: [], Role.BOTH: []}
        for node in nodes:
            node.slot = len(self.lists[node.spec.role])
            self.lists[node.spec.role].append(Candidate(node=node.live))  # type: ignore[arg-type]

    def refresh(self, node: SimNode) -> None:
        """The node's new heartbeat (``node.live``) into its candidate."""
        cand = Candidate(node=node.live, inflight=self.inflight.get(node.info.node_id, 0))  # type: ignore[arg-type]
        self.lists[node.info.role][node.slot] = cand

    def track(self, node: SimNode, delta: int) -> None:
        """As ``router.fleet.Fleet.track``: the router's own count of requests in flight on a node."""
        node_id = node.info.node_id
        left = self.inflight.get(node_id, 0) + delta
        if left > 0:
            self.inflight[node_id] = left
        else:
            self.inflight.pop(node_id, None)
        self.lists[node.info.role][node.slot] = Candidate(node=node.live, inflight=max(left, 0))  # type: ignore[arg-type]

    def route(self, r: SimRequest) -> Decision:
        """The policy's decision for ``r`` over the pools as they are now."""
        lists = self.lists
        if self.log is not None:  # the log keeps what the policy saw, so it gets copies
            pools = Pools(list(lists[Role.PREFILL]), list(lists[Role.DECODE]), list(lists[Role.BOTH]))
        else:
            pools = Pools(lists[Role.PREFILL], lists[Role.DECODE], lists[Role.BOTH])
        rr = RoutingRequest(
            request_id=r.request_id,
            model=self.model,
            prompt_token_ids=(0,) * r.prompt_tokens,
            session_id=r.session_id,
            block_keys=tuple(r.keys),
        )
        d = select_pools(self.policy, rr, pools)
        if self.log is not None:
            self.log.append(("route", (rr, pools, d)))
        return d
