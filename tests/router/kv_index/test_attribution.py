"""Miss attribution against a real FleetIndex fed real KV events (``router.kv_index.attribution``):
each kind alone, their boundaries together, the eviction history's bound, and the sum invariant."""

from __future__ import annotations

import random

from router.kv_index import BlockHasher, FleetIndex, MissAttribution, attribute, prefix_view
from router.kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 16
HASHER = BlockHasher(BS)
PROMPT = [random.Random(3).randrange(49_152) for _ in range(1000)]  # 62 whole blocks, the last one partial
KEYS = HASHER.keys(PROMPT)
CAP = (len(PROMPT) - 1) // BS * BS  # 992: what vLLM could ever reuse


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _stored(tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=HASHER.block_hashes(tokens), block_size=BS, medium="GPU")


def _removed(start: int, end: int) -> BlockRemoved:
    """BlockRemoved for the prompt's blocks holding tokens [start, end) (block-aligned)."""
    return BlockRemoved(block_hashes=HASHER.block_hashes(PROMPT[:end])[start // BS :], medium="GPU")


def _miss(
    fleet: FleetIndex,
    engine_cached: int,
    *,
    routed: str = "n0",
    live: set[str] | None = None,
    code: str = "best_prefix",
    now: float = 1000.0,
) -> MissAttribution:
    view = prefix_view(
        fleet,
        "m",
        KEYS,
        prompt_tokens=len(PROMPT),
        block_size=BS,
        routed_node=routed,
        live_nodes=live if live is not None else {"n0", "n1"},
        reason_code=code,
        now=now,
    )
    miss = attribute(view, engine_cached)
    assert miss.cold + miss.evicted + miss.elsewhere + miss.undelivered == miss.uncached == len(PROMPT) - engine_cached
    return miss


def test_a_prefix_the_fleet_never_had_is_cold() -> None:
    fleet = FleetIndex()
    fleet.model("m", BS)
    m = _miss(fleet, 0)
    assert (m.cold, m.evicted, m.elsewhere, m.undelivered) == (1000, 0, 0, 0)


def test_an_evicted_prefix_says_from_where_and_how_long_ago() -> None:
    clock = Clock()
    fleet = FleetIndex(clock=clock)
    idx = fleet.model("m", BS)
    idx.apply("n1", _stored(PROMPT[:640]))
    clock.t = 1010.0
    idx.apply("n1", _removed(320, 640))  # the engine evicted the second half of what it held
    m = _miss(fleet, 0, routed="n1", now=1025.5)
    assert (m.undelivered, m.elsewhere, m.evicted, m.cold) == (320, 0, 320, 360)
    # 320 undelivered: the index said n1 held them and the engine reported 0
    assert (m.evicted_node, m.evicted_tier, m.evicted_ago_s) == ("n1", "GPU", 15.5)
    m = _miss(fleet, 320, routed="n1", now=1025.5)
    assert (m.undelivered, m.evicted, m.cold) == (0, 320, 360)


def test_stored_again_leaves_the_history_and_other_causes_are_named() -> None:
    fleet = FleetIndex()
    idx = fleet.model("m", BS)
    idx.apply("n0", _stored(PROMPT[:320]))
    idx.apply("n0", AllBlocksCleared())
    assert _miss(fleet, 0).evicted_tier == "cleared"
    idx.apply("n1", _stored(PROMPT[:320]))
    assert len(idx.evicted) == 0  # held again: no longer evicted
    assert _miss(fleet, 0).elsewhere == 320
    idx.clear_node("n1", cause="events_lost")
    assert _miss(fleet, 0).evicted_tier == "events_lost"
    idx.apply("n1", _stored(PROMPT[:320]))
    fleet.drop_node("n1")
    m = _miss(fleet, 0)
    assert (m.evicted, m.evicted_node, m.evicted_tier) == (320, "n1", "node_left")


def test_a_block_another_node_still_holds_was_not_evicted() -> None:
    fleet = FleetIndex()
    idx = fleet.model("m", BS)
    idx.apply("n0", _stored(PROMPT[:320]))
    idx.apply("n1", _stored(PROMPT[:320]))
    idx.apply("n1", _removed(0, 320))
    assert len(idx.evicted) == 0
    assert _miss(fleet, 320).cold == 680


def test_elsewhere_names_the_holder_and_why_the_request_went_where_it_did() -> None:
    fleet = FleetIndex()
    fleet.model("m", BS).apply("n1", _stored(PROMPT[:800]))
    m = _miss(fleet, 0, routed="n0", code="load_guard")
    assert (m.elsewhere, m.cold, m.elsewhere_node, m.elsewhere_reason) == (800, 200, "n1", "load_guard")
    m = _miss(fleet, 0, routed="n0", live={"n0"}, code="best_prefix")
    assert (m.elsewhere, m.elsewhere_node, m.elsewhere_reason) == (800, "n1", "node_down")


def test_undelivered_is_what_the_index_promised_and_the_engine_did_not_reuse() -> None:
    fleet = FleetIndex()
    fleet.model("m", BS).add_blocks("n0", KEYS[:50])  # the index says n0 holds 800 tokens; the engine does not
    m = _miss(fleet, 304, routed="n0")
    assert (m.undelivered, m.elsewhere, m.evicted, m.cold) == (496, 0, 0, 200)
    assert _miss(fleet, 960, routed="n0").undelivered == 0  # the engine reused more than the index knew


def test_all_four_kinds_in_one_request_fall_on_their_boundaries() -> None:
    clock = Clock()
    fleet = FleetIndex(clock=clock)
    idx = fleet.model("m", BS)
    idx.apply("n1", _stored(PROMPT[:800]))
    idx.apply("n1", _removed(608, 800))  # fleet now: n1 holds 608; 608..800 evicted
    idx.add_blocks("n0", KEYS[:20])  # routed node holds 320 per the index
    m = _miss(fleet, 160, routed="n0")
    assert (m.undelivered, m.elsewhere, m.evicted, m.cold) == (160, 288, 192, 200)
    assert (m.elsewhere_node, m.evicted_node) == ("n1", "n1")


def test_a_whole_prompt_seen_before_leaves_its_last_block_cold() -> None:
    fleet = FleetIndex()
    fleet.model("m", BS).apply("n1", _stored(PROMPT))
    m = _miss(fleet, 0, routed="n1")
    assert m.undelivered == CAP and m.cold == len(PROMPT) - CAP


def test_the_eviction_history_is_bounded_oldest_first() -> None:
    fleet = FleetIndex(max_evicted=10)
    idx = fleet.model("m", BS)
    idx.apply("n1", _stored(PROMPT[:320]))  # 20 blocks
    idx.apply("n1", _removed(0, 320))
    assert len(idx.evicted) == 10
    # the first 10 blocks' evictions were forgotten: the prefix reads as cold from block 0
    assert _miss(fleet, 0).evicted == 0
    fleet0 = FleetIndex(max_evicted=0)
    idx0 = fleet0.model("m", BS)
    idx0.apply("n1", _stored(PROMPT[:320]))
    idx0.apply("n1", _removed(0, 320))
    assert len(idx0.evicted) == 0


def test_kinds_always_sum_to_the_uncached_tokens() -> None:
    from router.kv_index import PrefixView

    rng = random.Random(11)
    for _ in range(2000):
        p = rng.randrange(0, 5000)
        marks = sorted(rng.randrange(0, p + 1) for _ in range(3))
        view = PrefixView(
            prompt_tokens=p,
            routed_tokens=rng.choice(marks),
            fleet_tokens=marks[1],
            seen_tokens=marks[2],
            elsewhere_node="x",
            elsewhere_reason="load_guard",
            evicted_node="y",
        )
        e = rng.randrange(0, p + 1)
        m = attribute(view, e)
        assert min(m.cold, m.evicted, m.elsewhere, m.undelivered) >= 0
        assert m.cold + m.evicted + m.elsewhere + m.undelivered == m.uncached == p - e
        assert (m.elsewhere_node is None) == (m.elsewhere == 0) and (m.evicted_node is None) == (m.evicted == 0)


def test_reuse_splits_into_the_engine_s_own_and_its_host_tier_s() -> None:
    fleet = FleetIndex()
    idx = fleet.model("m", BS)
    fleet.set_tiers({("m", BS): {"n0": "tier@h"}})
    idx.apply("n0", _stored(PROMPT[: 10 * BS]))
    tier = HASHER.block_hashes(PROMPT[: 40 * BS])
    idx.apply("tier@h", BlockStored(block_hashes=tier, block_size=BS, medium="CPU_SHM"))
    # the engine reused all it was predicted to: 10 blocks its own, 30 from the tier
    miss = _miss(fleet, 40 * BS)
    assert (miss.local_hit, miss.host_tier_hit, miss.undelivered) == (10 * BS, 30 * BS, 0)
    assert miss.origin() == {"engine": 160, "host_tier": 480, "peer": 0, "computed": len(PROMPT) - 640}
    # it reused less than predicted: the tier's share is what it got beyond its own; the rest undelivered
    miss = _miss(fleet, 25 * BS)
    assert (miss.local_hit, miss.host_tier_hit, miss.undelivered) == (10 * BS, 15 * BS, 15 * BS)
    # less than its own prefix: no tier hit at all
    miss = _miss(fleet, 4 * BS)
    assert (miss.local_hit, miss.host_tier_hit) == (4 * BS, 0)


def test_a_prefix_loaded_from_a_peer_is_the_peer_s_share() -> None:
    from dataclasses import replace

    from router.kv_index import PrefixView

    # the router's view once the peer leased 40 blocks for a node holding 10 itself (router.planning.peer_fetch)
    view = PrefixView(
        prompt_tokens=len(PROMPT),
        fleet_tokens=40 * BS,
        routed_tokens=40 * BS,
        seen_tokens=40 * BS,
        routed_peer_tokens=30 * BS,
    )
    miss = attribute(view, 40 * BS)
    assert (miss.local_hit, miss.peer_hit, miss.host_tier_hit, miss.undelivered) == (10 * BS, 30 * BS, 0, 0)
    assert miss.origin() == {"engine": 160, "host_tier": 0, "peer": 480, "computed": len(PROMPT) - 640}
    assert miss.record()["peer_cached_tokens"] == 480
    # the pull fell short (the peer died): what was not reused is undelivered, never the peer's
    miss = attribute(view, 10 * BS)
    assert (miss.local_hit, miss.peer_hit, miss.undelivered) == (10 * BS, 0, 30 * BS)
    assert attribute(replace(view, routed_peer_tokens=0), 40 * BS).peer_hit == 0
