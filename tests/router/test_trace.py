"""``router.record.trace``'s fills, isolated: a peer fetch makes the fetched prefix the routed one for
miss attribution, and a retry after the decode leg failed undoes it (the retry's node computes or hits,
it loads nothing), with the retry's node and why in the trace."""

from __future__ import annotations

from contracts.registry import LiveNode, NodeInfo, NodeLoad, Role
from router.kv_index import PrefixView
from router.policies.base import Candidate
from router.record.trace import RequestTrace, note_colocated, note_pair, note_peer_fetch, note_retry


def _node(name: str, role: Role) -> Candidate:
    info = NodeInfo(
        node_id=name,
        role=role,
        model="m",
        url=f"http://127.0.0.1:1/{name}",
        block_size=16,
        max_model_len=4096,
        kv_connector="tandem",
    )
    return Candidate(LiveNode(info=info, load=NodeLoad()))


def _trace() -> RequestTrace:
    trace = RequestTrace(request_id="chatcmpl-1", kind="chat", model="m", reason="cache hit")
    trace.prefix_view = PrefixView(prompt_tokens=500, fleet_tokens=320, routed_tokens=64, seen_tokens=320)
    return trace


def test_a_peer_fetch_is_the_routed_prefix_and_a_retry_undoes_it() -> None:
    trace = _trace()
    trace.kv_params = {"transfer_id": "t"}
    note_peer_fetch(trace, "peer", prefix_tokens=320, own_tokens=64)
    assert (trace.peer_node, trace.peer_tokens, trace.kv_connector) == ("peer", 256, "tandem")
    assert trace.routed_cached_tokens == 320
    assert trace.prefix_view is not None
    assert (trace.prefix_view.routed_tokens, trace.prefix_view.routed_peer_tokens) == (320, 256)

    note_retry(trace, _node("other", Role.BOTH), "served by other")
    assert (trace.peer_node, trace.peer_tokens, trace.kv_params) == (None, 0, None)
    assert (trace.prefix_view.routed_tokens, trace.prefix_view.routed_peer_tokens) == (64, 0)
    assert (trace.fallback, trace.mode, trace.decode_node, trace.decode_role) == (True, "colocated", "other", "both")
    assert trace.reason == "cache hit; decode leg failed, served by other"


def test_a_retry_without_a_fetch_keeps_the_routed_prefix() -> None:
    trace = _trace()
    note_retry(trace, _node("p", Role.PREFILL), "served by the prefill node")
    assert trace.prefix_view is not None and trace.prefix_view.routed_tokens == 64
    assert (trace.mode, trace.decode_node, trace.decode_role) == ("colocated", "p", "prefill")


def test_a_pair_that_falls_back_to_colocated_moves_no_kv() -> None:
    trace = _trace()
    note_pair(trace, _node("p", Role.PREFILL))
    assert (trace.mode, trace.prefill_node, trace.kv_connector) == ("disaggregated", "p", "tandem")
    trace.kv_params = {"transfer_id": "t"}
    note_colocated(trace)
    assert (trace.mode, trace.kv_connector, trace.kv_params) == ("colocated", None, None)
