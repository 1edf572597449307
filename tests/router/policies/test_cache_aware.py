"""cache_aware against a real FleetIndex and real routing keys."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from contracts.registry import Role
from router.edge.services import make_policy
from router.kv_index import BlockHasher, FleetIndex
from router.policies import CacheAware, CacheAwareConfig, PeerReach, ReasonCode, RoutingRequest
from router.policies.base import Candidate
from router.settings import RouterSettings
from tests.router.policies.helpers import cand

BS = 16
HASHER = BlockHasher(BS)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49_152) for _ in range(n)]


def _req(tokens: list[int], session: str | None = None) -> RoutingRequest:
    return RoutingRequest(
        request_id="r",
        model="m",
        prompt_token_ids=tuple(tokens),
        block_keys=tuple(HASHER.keys(tokens)),
        session_id=session,
    )


def _fleet(holdings: dict[str, list[int]]) -> FleetIndex:
    fleet = FleetIndex()
    m = fleet.model("m", BS)
    for node, tokens in holdings.items():
        m.add_blocks(node, HASHER.keys(tokens))
    return fleet


PROMPT = _tokens(2000, seed=1)
OTHER = _tokens(2000, seed=2)
"""Shares no block with PROMPT: its routing sees PROMPT's node only as busy."""
DECODE = [cand("d0", Role.DECODE)]


def test_prefers_the_node_holding_the_prefix() -> None:
    fleet = _fleet({"p1": PROMPT[:1600], "p0": PROMPT[:320]})
    d = CacheAware(fleet).select(_req(PROMPT), [cand("p0"), cand("p1")], DECODE)
    assert d.prefill is not None and d.prefill.node_id == "p1"
    assert d.extra["fleet_cached_tokens"] == 1600
    assert d.extra["routed_cached_tokens"] == 1600
    assert d.extra["uncached_tokens"] == 400
    assert (d.code, d.decode_code, d.load, d.threshold) == (ReasonCode.BEST_PREFIX, ReasonCode.LEAST_BUSY, 0, None)
    assert d.reason.startswith("cache: p1")  # the sentence stays, for display


def test_queued_tokens_outweigh_a_small_cache_win() -> None:
    fleet = _fleet({"p1": PROMPT[:320]})
    policy = CacheAware(fleet)
    # p1 holds 320 tokens but has 2 requests waiting (2 * 1024 queued tokens): p0 wins
    d = policy.select(_req(PROMPT), [cand("p0"), cand("p1", waiting=2)], DECODE)
    assert d.prefill is not None and d.prefill.node_id == "p0"
    assert d.extra["fleet_cached_tokens"] == 320 and d.extra["routed_cached_tokens"] == 0


def test_own_queue_is_tracked_and_released() -> None:
    fleet = _fleet({"p1": PROMPT[:160]})
    policy = CacheAware(fleet)
    first = policy.select(_req(PROMPT), [cand("p0"), cand("p1")], DECODE)
    assert first.prefill is not None and first.prefill.node_id == "p1"
    # p1 now has 1840 uncached tokens queued from this router: another prompt goes to p0
    second = policy.select(_req(OTHER), [cand("p0"), cand("p1")], DECODE)
    assert second.prefill is not None and second.prefill.node_id == "p0"
    policy.on_complete(first)
    policy.on_complete(second)
    third = policy.select(_req(PROMPT), [cand("p0"), cand("p1")], DECODE)
    assert third.prefill is not None and third.prefill.node_id == "p1"


def test_the_queue_is_released_at_the_first_token_once() -> None:
    """A prompt's tokens leave its node's queue when its first token arrives (its prefill is done),
    not when its answer ends; ``on_complete`` afterwards releases nothing more."""
    fleet = _fleet({"p1": PROMPT[:160]})
    policy = CacheAware(fleet)
    first = policy.select(_req(PROMPT), [cand("p0"), cand("p1")], DECODE)
    assert first.prefill is not None and first.prefill.node_id == "p1"
    second = policy.select(_req(OTHER), [cand("p0"), cand("p1")], DECODE)
    assert second.prefill is not None and second.prefill.node_id == "p0"
    policy.on_prefilled(first)  # p1's prompt work is done while its answer streams on
    policy.on_prefilled(first)  # a repeat settles nothing twice
    policy.on_complete(first)
    # p0 still has 2,000 tokens queued (second's prefill is under way): p1, with its prefix, wins
    third = policy.select(_req(PROMPT), [cand("p0"), cand("p1")], DECODE)
    assert third.prefill is not None and third.prefill.node_id == "p1"
    assert third.reason.startswith("cache: p1") and "queue 0" in third.reason


def test_a_forced_p_d_copy_of_a_decision_settles_where_its_tokens_were_queued() -> None:
    """The router's forced P/D (``dataclasses.replace`` with another prefill node) and its decode
    retry are copies of the decision: they settle the tokens on the node they were added to."""
    policy = CacheAware(_fleet({}), CacheAwareConfig(local_prefill_max_tokens=4096))
    local = policy.select(_req(PROMPT), [cand("p0")], DECODE)
    assert local.prefill is None  # d0 prefills locally: 2,000 tokens queued on d0
    forced = replace(local, prefill=cand("p0"), code=ReasonCode.FORCED_PD)
    policy.on_complete(forced)
    # colocated, nothing cached: the emptier queue wins; d0's 2,000 tokens are gone (ties: node id)
    again = policy.select(_req(PROMPT), [], [cand("d0", Role.BOTH), cand("d1", Role.BOTH)])
    assert again.decode.node_id == "d0" and "queue 0" in again.reason, again.reason


def test_load_guard_falls_back_to_least_loaded() -> None:
    fleet = _fleet({"p1": PROMPT[:1600]})
    policy = CacheAware(fleet, CacheAwareConfig(imbalance_threshold=4, waiting_request_tokens=0))
    d = policy.select(_req(PROMPT), [cand("p0"), cand("p1", inflight=5)], DECODE)
    assert d.prefill is not None and d.prefill.node_id == "p0"
    assert (d.code, d.threshold, d.load) == (ReasonCode.LOAD_GUARD, 4, 5)
    within = policy.select(_req(PROMPT), [cand("p0"), cand("p1", inflight=4)], DECODE)
    assert within.prefill is not None and within.prefill.node_id == "p1"


def test_short_uncached_suffix_prefills_on_decode() -> None:
    turn = PROMPT[:1800]
    fleet = _fleet({"d1": turn, "p0": turn})
    decode = [cand("d0", Role.DECODE), cand("d1", Role.DECODE, running=3)]
    d = CacheAware(fleet, CacheAwareConfig(local_prefill_max_tokens=256)).select(_req(PROMPT), [cand("p0")], decode)
    assert d.prefill is None and d.decode.node_id == "d1"
    assert d.extra["routed_cached_tokens"] == 1792  # 112 whole blocks of the 1800 tokens
    assert (d.code, d.decode_code, d.threshold, d.load) == (ReasonCode.LOCAL_PREFILL, ReasonCode.MOST_CACHED, 256, 0)
    assert d.extra["uncached_tokens"] == 208
    # a longer new suffix goes through the prefill pool
    longer = PROMPT + _tokens(400, seed=2)
    d2 = CacheAware(fleet, CacheAwareConfig(local_prefill_max_tokens=256)).select(_req(longer), [cand("p0")], decode)
    assert d2.prefill is not None and d2.prefill.node_id == "p0"


def test_whole_prompt_match_reuses_one_block_less() -> None:
    prompt = PROMPT[: 50 * BS]  # exactly 50 blocks
    fleet = _fleet({"p0": prompt})
    d = CacheAware(fleet, CacheAwareConfig(local_prefill_max_tokens=0)).select(_req(prompt), [cand("p0")], DECODE)
    assert d.extra["routed_cached_tokens"] == 49 * BS
    assert d.extra["fleet_cached_tokens"] == 49 * BS


def test_saturated_prefill_pool_prefills_on_decode() -> None:
    policy = CacheAware(FleetIndex(), CacheAwareConfig(prefill_saturation_load=4))
    d = policy.select(_req(PROMPT), [cand("p0", waiting=4), cand("p1", inflight=5)], DECODE)
    assert d.prefill is None
    assert (d.code, d.threshold, d.load) == (ReasonCode.PREFILL_SATURATED, 4, 4)


def test_session_affinity_keeps_the_decode_node() -> None:
    policy = CacheAware(FleetIndex(), CacheAwareConfig(imbalance_threshold=2))
    decode = [cand("d0", Role.DECODE), cand("d1", Role.DECODE, running=1)]
    first = policy.select(_req(PROMPT, "s1"), [cand("p0")], decode)
    assert first.decode.node_id == "d0" and first.decode_code == ReasonCode.LEAST_BUSY
    busier = [cand("d0", Role.DECODE, inflight=2), cand("d1", Role.DECODE)]
    kept = policy.select(_req(PROMPT, "s1"), [cand("p0")], busier)
    assert kept.decode.node_id == "d0" and kept.decode_code == ReasonCode.SESSION_AFFINITY
    too_busy = [cand("d0", Role.DECODE, inflight=3), cand("d1", Role.DECODE)]
    moved = policy.select(_req(PROMPT, "s1"), [cand("p0")], too_busy)
    assert moved.decode.node_id == "d1" and moved.decode_code == ReasonCode.LEAST_BUSY


def test_colocated_routes_on_the_decode_pool_cache() -> None:
    fleet = _fleet({"b1": PROMPT[:1000]})
    both = [cand("b0", Role.BOTH), cand("b1", Role.BOTH)]
    d = CacheAware(fleet).select(_req(PROMPT), [], both)
    assert d.prefill is None and d.decode.node_id == "b1"
    assert d.extra["routed_cached_tokens"] == 992
    assert d.code == d.decode_code == ReasonCode.BEST_PREFIX


def test_unknown_tokens_do_not_force_local_prefill() -> None:
    d = CacheAware(FleetIndex()).select(RoutingRequest(request_id="r", model="m"), [cand("p0")], DECODE)
    assert d.prefill is not None
    assert d.extra["fleet_cached_tokens"] == 0 and d.extra["prompt_tokens"] == 0


def test_colocated_session_affinity_carries_its_guard() -> None:
    policy = CacheAware(FleetIndex(), CacheAwareConfig(imbalance_threshold=2))
    both = [cand("b0", Role.BOTH), cand("b1", Role.BOTH, running=1)]
    assert policy.select(_req(PROMPT, "s"), [], both).code == ReasonCode.BEST_PREFIX
    again = policy.select(_req(PROMPT, "s"), [], [cand("b0", Role.BOTH, inflight=1), cand("b1", Role.BOTH)])
    assert (again.decode.node_id, again.code, again.threshold, again.load) == ("b0", ReasonCode.SESSION_AFFINITY, 2, 1)


def _colocated(*names: str) -> list[Candidate]:
    return [cand(n, Role.BOTH) for n in names]


def test_a_sibling_meets_its_context_where_waiting_costs_less_than_computing_it_again() -> None:
    """Two sessions of one repository arriving together: the context the first is computing counts as
    cached on its node for the second (pending), against that node's queue. Behind a whole cold prompt
    the second computes the context again on the idle node (sooner for it); behind half of one (the
    first split with that node) it waits there and computes only its own turn. Once prefilled, nothing
    of a prompt is pending any more."""
    policy = CacheAware(_fleet({}))
    context = PROMPT[:1600]
    first = policy.select(_req(context + _tokens(100, seed=5)), [], _colocated("a", "b"))
    assert first.decode.node_id == "a"  # (a tie: by node id)
    sibling = policy.select(_req(context + _tokens(120, seed=6)), [], _colocated("a", "b"))
    assert sibling.decode.node_id == "b"  # 1,700 queued on a against 1,600 shared
    policy.on_complete(sibling)
    policy.on_split(first, "b", 848)  # b computes the first 848 tokens, a the rest
    sibling = policy.select(_req(context + _tokens(120, seed=6)), [], _colocated("a", "b"))
    assert sibling.decode.node_id == "a" and sibling.extra["routed_cached_tokens"] >= 1536
    assert sibling.extra["fleet_cached_tokens"] == 0  # what is cached now: nothing yet
    stranger = policy.select(_req(OTHER), [], _colocated("a", "b"))
    assert stranger.decode.node_id == "b"  # no shared block: a's queue is the longer
    for d in (first, sibling, stranger):
        policy.on_prefilled(d)
    later = policy.select(_req(context + _tokens(90, seed=7)), [], _colocated("a", "b"))
    assert later.extra["routed_cached_tokens"] == 0  # (the index, empty here, is the only source again)


def test_a_split_moves_the_prefix_to_the_helpers_queue_and_pending_blocks() -> None:
    """After ``on_split`` the helper is busy with the prefix's tokens (another cold prompt goes to the
    serving node, whose queue is the rest) and holds the prefix pending; settling takes both back."""
    policy = CacheAware(_fleet({}))
    first = policy.select(_req(PROMPT), [], _colocated("a", "b"))
    assert first.decode.node_id == "a"
    policy.on_split(first, "b", 1024)
    assert policy._queued == {"a": 2000 - 1024, "b": 1024}
    other = policy.select(_req(OTHER), [], _colocated("a", "b"))
    assert other.decode.node_id == "a"  # 976 queued there against 1024 on b
    sibling = policy.select(_req(PROMPT[:1500] + _tokens(50, seed=8)), [], _colocated("a", "b"))
    assert sibling.extra["routed_cached_tokens"] >= 1024  # the helper's pending prefix counts on b ...
    policy.on_complete(first)
    policy.on_complete(other)
    policy.on_complete(sibling)
    assert policy._queued == {}  # ... and every token queued is settled where it was added


def _reach(fleet: FleetIndex, serving: set[str]) -> PeerReach:
    return PeerReach(fleet.own_prefix, lambda c: c.node_id in serving)


def test_peer_reach_sends_a_context_to_an_idle_node_that_can_fetch_it_from_a_busy_holder() -> None:
    fleet = _fleet({"b0": PROMPT[:1600], "b1": PROMPT[:64]})
    busy = [cand("b0", Role.BOTH, inflight=3), cand("b1", Role.BOTH)]
    # without it the context's holder wins however busy (1,600 cached against 64)
    assert CacheAware(fleet).select(_req(PROMPT), [], busy).decode.node_id == "b0"
    policy = CacheAware(fleet, peer_reach=_reach(fleet, {"b0", "b1"}))
    d = policy.select(_req(PROMPT), [], busy)
    assert d.decode.node_id == "b1" and d.prefill is None
    assert d.extra["routed_cached_tokens"] == 1600  # what the peer fetch will load there
    assert d.extra["fleet_cached_tokens"] == 1600


def test_peer_reach_leaves_a_whole_tie_to_the_holder_and_needs_two_nodes_that_serve_peers() -> None:
    fleet = _fleet({"b1": PROMPT[:1600]})
    idle = [cand("b0", Role.BOTH), cand("b1", Role.BOTH)]
    both = CacheAware(fleet, peer_reach=_reach(fleet, {"b0", "b1"}))
    assert both.select(_req(PROMPT), [], idle).decode.node_id == "b1"  # (b0 would win a tie by name)
    busy = [cand("b0", Role.BOTH), cand("b1", Role.BOTH, inflight=3)]
    one = CacheAware(fleet, peer_reach=_reach(fleet, {"b0"}))  # b1 serves no peer: nothing to fetch
    assert one.select(_req(PROMPT), [], busy).decode.node_id == "b1"


def test_the_router_settings_turn_peer_reach_on_by_default_and_only_with_peer_fetch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TANDEM_ROUTER_PEER_REACH", raising=False)
    monkeypatch.delenv("TANDEM_ROUTER_PEER_FETCH", raising=False)
    fleet = FleetIndex()
    on = make_policy(RouterSettings(), fleet)
    assert isinstance(on, CacheAware) and on.peer_reach is not None
    for off in (RouterSettings(peer_reach=False), RouterSettings(peer_fetch=False)):
        policy = make_policy(off, fleet)
        assert isinstance(policy, CacheAware) and policy.peer_reach is None
