from __future__ import annotations

from contracts.registry import Role
from router.policies import LeastLoaded, RoundRobin, RoutingRequest
from tests.router.policies.helpers import cand


def test_each_pool_rotates_in_node_order() -> None:
    rr = RoundRobin()
    prefill = [cand("p1"), cand("p0")]
    decode = [cand("d0", Role.DECODE)]
    picks = [rr.select(RoutingRequest(request_id=str(i), model="m"), prefill, decode) for i in range(4)]
    assert [d.prefill.node_id for d in picks if d.prefill] == ["p0", "p1", "p0", "p1"]
    assert {d.decode.node_id for d in picks} == {"d0"}
    assert all(d.policy == "round_robin" for d in picks)


def test_colocated_has_no_prefill() -> None:
    d = RoundRobin().select(RoutingRequest(request_id="r", model="m"), [], [cand("a", Role.BOTH)])
    assert d.prefill is None and not d.disaggregated


def test_least_loaded_still_works() -> None:
    d = LeastLoaded().select(
        RoutingRequest(request_id="r", model="m", block_keys=(1, 2)),
        [cand("p0", inflight=3), cand("p1", waiting=1)],
        [cand("d0", Role.DECODE)],
    )
    assert d.prefill is not None and d.prefill.node_id == "p1"
