from __future__ import annotations

from contracts.registry import LiveNode, NodeInfo, NodeLoad, Role
from router.policies import Candidate, LeastLoaded, ReasonCode, RoutingRequest


def _cand(node_id: str, role: Role, inflight: int = 0, waiting: int = 0, kv: float = 0.0) -> Candidate:
    info = NodeInfo(
        node_id=node_id, role=role, model="m", url="u", block_size=16, max_model_len=1024, kv_connector="nixl"
    )
    return Candidate(node=LiveNode(info=info, load=NodeLoad(waiting=waiting, kv_usage=kv)), inflight=inflight)


REQ = RoutingRequest(request_id="r", model="m")


def test_picks_fewest_inflight_plus_waiting_in_each_pool() -> None:
    p = [_cand("p1", Role.PREFILL, inflight=2), _cand("p2", Role.PREFILL, inflight=0, waiting=1)]
    d = [_cand("d1", Role.DECODE, inflight=1, waiting=3), _cand("d2", Role.DECODE, inflight=3)]
    decision = LeastLoaded().select(REQ, p, d)
    assert decision.prefill is not None and decision.prefill.node_id == "p2"
    assert decision.decode.node_id == "d2"
    assert decision.disaggregated
    assert (decision.code, decision.decode_code, decision.load) == (ReasonCode.LEAST_LOADED, ReasonCode.LEAST_LOADED, 1)


def test_ties_break_on_kv_usage_then_id_and_no_prefill_pool_means_colocated() -> None:
    d = [_cand("b", Role.BOTH, kv=0.5), _cand("c", Role.BOTH, kv=0.1), _cand("a", Role.BOTH, kv=0.1)]
    decision = LeastLoaded().select(REQ, [], d)
    assert decision.prefill is None and decision.decode.node_id == "a"
    assert not decision.disaggregated
