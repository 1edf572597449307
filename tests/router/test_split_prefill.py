"""When the router splits a cold prompt across two idle colocated nodes (``router.planning.split_prefill``),
and where it cuts it: only idle nodes that run our connector, only prompts the serving node would
mostly compute, never what a peer already holds (a fetch's business), the cut balancing the two halves."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from contracts.registry import LiveNode, NodeInfo, NodeLoad, Role
from router.planning.split_prefill import SplitPrefill, idle
from router.policies.base import Candidate

BS = 16


class Index:
    def __init__(self, own: dict[str, int] | None = None, longest: dict[str, int] | None = None) -> None:
        self.own, self.longest = own or {}, longest or {}

    def own_prefix(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        return self.own

    def longest_prefix(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        return self.longest or self.own


def node(name: str, *, running: int = 0, inflight: int = 0, peer_kv: bool = True, at: float = 0.0) -> Candidate:
    info = NodeInfo(
        node_id=name,
        role=Role.BOTH,
        url=f"http://{name}",
        model="m",
        max_model_len=4096,
        block_size=BS,
        kv_connector="tandem" if peer_kv else "",
        kv_endpoints={"tcp": f"tcp://{name}:1"} if peer_kv else {},
        kv_host_id="h" if peer_kv else "",
    )
    return Candidate(node=LiveNode(info=info, load=NodeLoad(running=running, updated_at=at)), inflight=inflight)


KEYS = list(range(100))


def test_a_cold_prompt_on_two_idle_nodes_is_cut_in_half_on_a_block() -> None:
    a, b = node("a"), node("b")
    plan = SplitPrefill(Index(), min_tokens=1024).plan("m", KEYS, 1537, a, [a, b])
    assert plan is not None and plan.helper.node_id == "b"
    assert plan.prefix_tokens == 768 and plan.local_tokens == 0


def test_what_the_helper_holds_moves_the_cut_toward_the_end() -> None:
    a, b = node("a"), node("b")
    plan = SplitPrefill(Index(own={"b": 8}), min_tokens=512).plan("m", KEYS, 1600, a, [a, b])
    assert plan is not None and plan.prefix_tokens == (1600 + 8 * BS) // 2 // BS * BS


def test_no_split_for_a_busy_node_a_short_prompt_a_held_prefix_or_a_node_without_our_connector() -> None:
    split = SplitPrefill(Index(), min_tokens=1024)
    a, b = node("a"), node("b")
    assert split.plan("m", KEYS, 1000, a, [a, b]) is None  # too short to pay for a second leg
    assert split.plan("m", KEYS, 1600, node("a", running=1), [b]) is None  # the server is busy
    assert split.plan("m", KEYS, 1600, a, [node("b", inflight=1)]) is None  # the helper is busy
    assert split.plan("m", KEYS, 1600, a, [node("b", peer_kv=False)]) is None
    assert split.plan("m", KEYS, 1600, node("a", peer_kv=False), [b]) is None
    # the helper holds most of the prompt: that is a fetch (router.planning.peer_fetch), not a split
    assert SplitPrefill(Index(own={"b": 60}), min_tokens=1024).plan("m", KEYS, 1600, a, [a, b]) is None
    # the serving node holds most of it: too little left to share
    assert SplitPrefill(Index(own={"a": 60}), min_tokens=512).plan("m", KEYS, 1600, a, [a, b]) is None


def test_idle_means_nothing_running_waiting_or_in_flight() -> None:
    assert idle(node("a"))
    assert not idle(node("a", running=1)) and not idle(node("a", inflight=1))


def test_a_heartbeat_s_busy_count_that_this_router_s_ended_requests_explain_is_idle() -> None:
    """A heartbeat taken while a short request of ours ran there, read after it ended, says busy."""
    ended = {"a": [99.0, 101.0]}  # when this router's requests on a ended; the heartbeat was taken at 100

    def ended_since(node_id: str, t: float) -> int:
        return sum(1 for e in ended.get(node_id, []) if e > t)

    assert idle(node("a", running=1, at=100.0), ended_since)
    assert not idle(node("a", running=2, at=100.0), ended_since)  # one more than ours: someone's still there
    assert not idle(node("a", running=1, at=102.0), ended_since)  # taken after ours ended: another request
    assert not idle(node("a", running=1, inflight=1, at=100.0), ended_since)
    split = SplitPrefill(Index(), min_tokens=1024)
    a, b = node("a", running=1, at=100.0), node("b")
    assert split.plan("m", KEYS, 1600, a, [a, b]) is None
    assert split.plan("m", KEYS, 1600, a, [a, b], ended_since=ended_since) is not None


def test_the_fleet_counts_a_node_s_requests_that_ended_after_a_time() -> None:
    from router.fleet import Fleet

    fleet = Fleet(registry=None)  # type: ignore[arg-type]  # the counters alone: never started, no registry read
    t0 = time.time()
    with fleet.track(node("a")):
        assert fleet.inflight("a") == 1 and fleet.ended_since("a", t0 - 1) == 0
    assert fleet.inflight("a") == 0 and fleet.ended_since("a", t0 - 1) == 1
    assert fleet.ended_since("a", time.time() + 1) == 0 and fleet.ended_since("b", 0.0) == 0


def test_a_pinned_request_is_never_split() -> None:
    """``x-tandem-node`` pins a request to its node alone: the router plans no split for it, and plans one
    for the same request routed by the policy (the legs' own check, before the planner)."""
    from types import SimpleNamespace

    from router.fleet import Pools
    from router.planning.legs import Legs
    from router.policies.base import Decision, ReasonCode, RoutingRequest

    a, b = node("a"), node("b")
    legs = SimpleNamespace(
        splits=SplitPrefill(Index(), min_tokens=1024),
        fleet=SimpleNamespace(is_down=lambda n: False, inflight=lambda n: 0, ended_since=lambda n, t: 0),
    )
    rr = RoutingRequest(request_id="r", model="m", prompt_token_ids=tuple(range(1600)), block_keys=tuple(KEYS))
    pools = Pools(prefill=[], decode=[], colocated=[a, b])
    for code, split in ((ReasonCode.PINNED, False), (ReasonCode.BEST_PREFIX, True)):
        decision = Decision(decode=a, prefill=None, policy="cache_aware", code=code, decode_code=code)
        assert (Legs._split_plan(legs, decision, rr, pools) is not None) is split  # type: ignore[arg-type]


def test_requests_to_a_split_node_wait_for_its_steps_to_start(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """For ``hold_s`` after a split, a request to either of its nodes waits (so the engines' next steps
    hold the split alone); requests to other nodes, and any after the hold, go at once."""
    import asyncio

    from router.planning import split_prefill

    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    monkeypatch.setattr(split_prefill.asyncio, "sleep", sleep)
    clock = [100.0]
    monkeypatch.setattr(split_prefill.time, "monotonic", lambda: clock[0])
    split = SplitPrefill(Index(), min_tokens=1024, hold_s=0.1)
    asyncio.run(split.wait_hold("a"))
    assert waits == []  # no split yet
    split.hold("a", "b")
    clock[0] += 0.03
    asyncio.run(split.wait_hold("c", None))
    asyncio.run(split.wait_hold("c", "b"))
    assert waits == [pytest.approx(0.07)]  # only the request that touches a split node
    clock[0] += 0.1
    asyncio.run(split.wait_hold("a"))
    assert len(waits) == 1  # the hold is over


def test_no_split_over_a_node_in_a_split_or_busy_by_the_live_count() -> None:
    """Candidates are snapshots taken when a request was routed. A second prompt planned after a first
    one's split must not split over the same nodes (in the opposite direction each node's step would
    wait on the other's): the hold and this router's live count both refuse it."""
    a, b = node("a"), node("b")
    split = SplitPrefill(Index(), min_tokens=1024)
    assert split.plan("m", KEYS, 1600, a, [a, b]) is not None
    assert split.plan("m", KEYS, 1600, a, [a, b], inflight=lambda n: int(n == "a")) is None
    assert split.plan("m", KEYS, 1600, a, [a, b], inflight=lambda n: int(n == "b")) is None
    split.hold("a", "b")
    assert split.plan("m", KEYS, 1600, b, [a, b]) is None
