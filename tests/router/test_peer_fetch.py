"""``router.planning.peer_fetch``'s decision, isolated (a stand-in index answers the prefix lookups): fetch a
peer's prefix only when the predicted fetch beats computing it, from the peer holding the most, only
between nodes that serve peers; measurements move the rates, so a slow source stops being asked."""

from __future__ import annotations

from collections.abc import Sequence

from contracts.registry import LiveNode, NodeInfo, NodeLoad, Role
from router.planning.peer_fetch import (
    PRIOR_PREFILL_S_PER_TOKEN,
    PRIOR_SOURCE_S,
    FetchRates,
    PeerFetch,
)
from router.policies.base import Candidate

BS = 16
KEYS = tuple(range(1000, 1064))  # 64 blocks
PROMPT = len(KEYS) * BS + 5


class Index:
    def __init__(self, own: dict[str, int], tier: dict[str, int] | None = None) -> None:
        self.own, self.tier = own, tier or {}

    def own_prefix(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        return dict(self.own)

    def longest_prefix(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        return {n: self.own.get(n, 0) + self.tier.get(n, 0) for n in {*self.own, *self.tier}}


def node(name: str, *, peer: bool = True, waiting: int = 0, block_size: int = BS) -> Candidate:
    info = NodeInfo(
        node_id=name,
        role=Role.BOTH,
        model="m",
        url=f"http://127.0.0.1:1/{name}",
        block_size=block_size,
        max_model_len=4096,
        kv_connector="tandem" if peer else "none",
        kv_endpoints={"tcp": "tcp://127.0.0.1:2"} if peer else {},
        kv_host_id="host" if peer else "",
    )
    return Candidate(LiveNode(info=info, load=NodeLoad(waiting=waiting)))


def test_a_peer_holding_more_is_fetched_from_up_to_the_last_whole_block() -> None:
    x, y = node("x"), node("y")
    verdict = PeerFetch(Index({"x": 4, "y": 64}), min_tokens=256).plan("m", KEYS, PROMPT, x, [x, y])
    assert verdict is not None and verdict.outcome == "planned" and verdict.plan is not None
    plan = verdict.plan
    assert plan.source is y and plan.prefix_tokens == 64 * BS and plan.local_tokens == plan.own_tokens == 4 * BS
    assert plan.fetch_s < plan.compute_s == (64 - 4) * BS * PRIOR_PREFILL_S_PER_TOKEN


def test_the_whole_prompt_is_never_fetched() -> None:
    x, y = node("x"), node("y")
    prompt = 64 * BS  # block-aligned: its last block holds the last token, computed on x
    plan = PeerFetch(Index({"y": 64}), min_tokens=256).plan("m", KEYS, prompt, x, [x, y]).plan  # type: ignore[union-attr]
    assert plan is not None and plan.prefix_tokens == 63 * BS


def test_no_verdict_when_no_peer_would_save_enough() -> None:
    x, y = node("x"), node("y")
    assert PeerFetch(Index({"x": 50, "y": 64}), min_tokens=256).plan("m", KEYS, PROMPT, x, [x, y]) is None
    # x's host tier already gives it most of the prefix: a fetch would save too little
    tiered = Index({"x": 4, "y": 64}, tier={"x": 50})
    assert PeerFetch(tiered, min_tokens=256).plan("m", KEYS, PROMPT, x, [x, y]) is None


def test_only_nodes_that_serve_peers_take_part() -> None:
    x, y, plain = node("x"), node("y", peer=False), node("z", block_size=32)
    assert PeerFetch(Index({"y": 64, "z": 64}), 256).plan("m", KEYS, PROMPT, x, [x, y, plain]) is None
    assert PeerFetch(Index({"y": 64}), 256).plan("m", KEYS, PROMPT, node("x", peer=False), [y]) is None


def test_computing_wins_when_the_peer_is_slower() -> None:
    x, busy = node("x"), node("y", waiting=3)
    verdict = PeerFetch(Index({"y": 64}), 256).plan("m", KEYS, PROMPT, x, [x, busy])
    # three waiting requests of ~1k tokens each on the peer: its leg would outlast computing 1k here
    assert verdict is not None and verdict.plan is None and verdict.outcome == "slower"


def test_the_best_source_is_the_one_holding_most_then_the_least_busy() -> None:
    x, a, b, c = node("x"), node("a"), node("b"), node("c", waiting=1)
    plan = PeerFetch(Index({"a": 40, "b": 64, "c": 64}), 256).plan("m", KEYS, PROMPT, x, [x, a, b, c]).plan  # type: ignore[union-attr]
    assert plan is not None and plan.source is b


def test_measurements_move_the_decision() -> None:
    rates = FetchRates()
    x, y = node("x"), node("y")
    fetch = PeerFetch(Index({"y": 64}), 256, rates)
    assert fetch.plan("m", KEYS, PROMPT, x, [x, y]).plan is not None  # type: ignore[union-attr]
    for _ in range(20):  # the source's legs take 5 s (a busy peer the heartbeat did not show)
        rates.observe_source("y", 5.0)
    assert rates.source_s("y") > 4.0
    assert fetch.plan("m", KEYS, PROMPT, x, [x, y]).outcome == "slower"  # type: ignore[union-attr]
    rates.observe_prefill("x", 100, 100.0)  # too few tokens to say anything about prefill
    assert rates.prefill_s_per_token("x") == PRIOR_PREFILL_S_PER_TOKEN
    rates.observe_prefill("x", 1000, 20.0)  # 20 ms a token here: now a 5 s leg beats computing 1k tokens
    assert fetch.plan("m", KEYS, PROMPT, x, [x, y]).outcome == "planned"  # type: ignore[union-attr]
    assert rates.source_s("other") == PRIOR_SOURCE_S


def test_an_average_not_measured_for_a_while_drifts_back_to_its_prior(monkeypatch) -> None:
    import router.planning.peer_fetch as pf

    now = [1000.0]
    monkeypatch.setattr(pf.time, "monotonic", lambda: now[0])
    rates = FetchRates()
    rates.observe_source("y", 10.0)  # one slow leg, blended with the prior
    first = rates.source_s("y")
    assert PRIOR_SOURCE_S < first < 10.0
    now[0] += pf.FORGET_S * 5  # nothing measured since: the peer is worth asking again
    assert abs(rates.source_s("y") - PRIOR_SOURCE_S) < 0.01 * first
