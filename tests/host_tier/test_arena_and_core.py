"""The host tier's file and state machine in one process: what a reader gets back, the bound, the
eviction order, abandoned writes, and a restart."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from host_tier import messages as m
from host_tier.arena import Arena
from host_tier.server import TierCore

FP = hashlib.sha256(b"layout-a").digest()
SLOT = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def arena(tmp_path: Path) -> Arena:
    return Arena.create(tmp_path / "tier", SLOT, 4, FP)


def put(core: TierCore, i: int) -> int:
    reserved = core.handle(m.Reserve([key(i)]))
    assert isinstance(reserved, m.Reserved)
    slot = reserved.slots[0]
    if slot >= 0:
        core.arena.write(slot, key(i), block(i))
        core.handle(m.Commit([slot], [key(i)]))
    return slot


def held(core: TierCore, ids: range) -> list[int]:
    return [i for i in ids if key(i) in core.by_key]


def test_a_block_reads_back_whole_and_only_under_its_own_key(arena: Arena) -> None:
    arena.write(0, key(0), block(0))
    assert arena.read(0, key(0)) == block(0).tobytes()
    assert arena.read(0, key(1)) is None  # the slot holds another block: never served for this key


def test_a_corrupt_byte_or_an_unfinished_write_is_not_served(arena: Arena) -> None:
    arena.write(0, key(0), block(0))
    arena.data(0)[100] ^= 0xFF  # a flipped bit in RAM, or a stray writer
    assert arena.read(0, key(0)) is None
    arena.write(1, key(1), block(1))
    arena.begin_write(1)  # a writer killed mid-copy leaves gen odd
    assert arena.read(1, key(1)) is None


def test_a_slot_reused_during_a_read_fails_the_read() -> None:
    """The seqlock: a reader that copied while the slot was rewritten gets False, not mixed bytes."""
    arena_path = Path("/dev/shm") / f"tandem-tier-test-{np.random.default_rng().integers(1 << 30)}"
    arena = Arena.create(arena_path, SLOT, 1, FP)
    try:
        arena.write(0, key(0), block(0))
        out = np.empty(SLOT, dtype=np.uint8)
        real_data = arena.data

        def data_then_overwrite(slot: int) -> np.ndarray:
            view = real_data(slot)
            arena.data = real_data  # type: ignore[method-assign]
            arena.write(0, key(1), block(1))  # the server reused the slot mid-read
            return view

        arena.data = data_then_overwrite  # type: ignore[method-assign]
        assert arena.read_into(0, key(0), out) is False
    finally:
        arena.close()
        arena_path.unlink()


def test_the_tier_is_bounded_and_evicts_least_recently_used(arena: Arena) -> None:
    core = TierCore(arena)
    for i in range(4):
        assert put(core, i) >= 0
    core.handle(m.Lookup([key(0)]))  # 0 is used again: 1 is now the oldest
    for i in range(4, 6):
        assert put(core, i) >= 0
    assert held(core, range(6)) == [0, 3, 4, 5]
    stats = core.stats()
    assert (stats.held, stats.evictions) == (4, {"lru": 2})


def test_pinned_blocks_are_evicted_last_and_only_until_their_ttl(arena: Arena) -> None:
    clock = Clock()
    core = TierCore(arena, clock=clock)
    for i in range(4):
        put(core, i)
    assert core.handle(m.Pin([key(0), key(1)], ttl_s=60.0)) == m.Pinned(2)
    put(core, 4)
    put(core, 5)
    assert held(core, range(6)) == [0, 1, 4, 5]  # the unpinned 2 and 3 went first
    put(core, 6)  # nothing unpinned but 4, 5: the oldest of those
    assert held(core, range(7)) == [0, 1, 5, 6]
    clock.t += 61  # the pins expired: 0 and 1 are plain LRU again, and the oldest
    put(core, 7)
    assert held(core, range(8)) == [1, 5, 6, 7]
    assert core.stats().evictions == {"lru": 4}


def test_when_everything_is_pinned_the_soonest_expiry_goes(arena: Arena) -> None:
    clock = Clock()
    core = TierCore(arena, clock=clock)
    for i in range(4):
        put(core, i)
        core.handle(m.Pin([key(i)], ttl_s=100.0 - i))
    put(core, 4)
    assert key(3) not in core.by_key
    assert core.stats().evictions == {"pinned_lru": 1}


def test_lookup_returns_the_held_prefix(arena: Arena) -> None:
    core = TierCore(arena)
    put(core, 0)
    put(core, 1)
    put(core, 3)
    found = core.handle(m.Lookup([key(0), key(1), key(2), key(3)]))
    assert isinstance(found, m.Found) and len(found.slots) == 2
    found = core.handle(m.Lookup([key(0), key(2), key(3)], prefix=False))
    assert isinstance(found, m.Found) and [s >= 0 for s in found.slots] == [True, False, True]


def test_a_writer_that_vanishes_gives_its_slot_back(arena: Arena) -> None:
    clock = Clock()
    core = TierCore(arena, write_timeout_s=30.0, clock=clock)
    reserved = core.handle(m.Reserve([key(i) for i in range(4)]))
    assert isinstance(reserved, m.Reserved) and min(reserved.slots) >= 0
    assert core.handle(m.Reserve([key(9)])) == m.Reserved([-1])  # every slot is being written
    clock.t += 31
    assert put(core, 9) >= 0  # the abandoned reservations were reclaimed
    stats = core.stats()
    assert (stats.held, stats.writing, stats.reclaimed) == (1, 0, 4)
    core.handle(m.Commit(reserved.slots[:1], [key(0)]))  # the late writer's commit is void
    assert key(0) not in core.by_key


def test_a_restarted_server_finds_every_whole_block_and_only_those(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    core = TierCore(Arena.create(path, SLOT, 4, FP))
    for i in range(3):
        put(core, i)
    core.arena.data(core.by_key[key(1)])[7] ^= 1  # corrupted while the server was down
    core.arena.begin_write(core.free[-1])  # and a write that never finished
    core.arena.close()

    again = TierCore(Arena.create(path, SLOT, 4, FP))
    assert sorted(again.by_key) == sorted([key(0), key(2)])
    assert len(again.free) == 2
    assert again.arena.read(again.by_key[key(0)], key(0)) == block(0).tobytes()


def test_a_file_of_another_layout_is_replaced_not_read(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    core = TierCore(Arena.create(path, SLOT, 4, FP))
    put(core, 0)
    core.arena.close()
    other = TierCore(Arena.create(path, SLOT, 4, hashlib.sha256(b"layout-b").digest()))
    assert other.by_key == {}


def test_a_duplicate_commit_keeps_one_copy(arena: Arena) -> None:
    core = TierCore(arena)
    a = core.handle(m.Reserve([key(0)]))
    b = core.handle(m.Reserve([key(0)]))  # two engines offload the same block at once
    assert isinstance(a, m.Reserved) and isinstance(b, m.Reserved)
    for r in (a, b):
        arena.write(r.slots[0], key(0), block(0))
        core.handle(m.Commit(r.slots, [key(0)]))
    stats = core.stats()
    assert (stats.held, stats.stored, len(core.free)) == (1, 1, 3)


def test_a_late_writer_neither_seals_nor_disturbs_the_slot_s_new_owner(arena: Arena) -> None:
    clock = Clock()
    core = TierCore(arena, write_timeout_s=30.0, clock=clock)
    late = core.handle(m.Reserve([key(0)]))
    assert isinstance(late, m.Reserved)
    slot = late.slots[0]
    late_gen = arena.begin_write(slot)  # writer A starts, then stalls past the timeout
    clock.t += 31
    for i in (1, 2, 3):
        put(core, i)
    nxt = core.handle(m.Reserve([key(4)]))  # the reclaimed slot goes to writer B
    assert isinstance(nxt, m.Reserved) and nxt.slots == [slot]
    b_gen = arena.begin_write(slot)
    arena.data(slot)[: SLOT // 2] = block(4)[: SLOT // 2]
    assert arena.end_write(slot, key(0), SLOT, late_gen) is False  # A's seal over B's bytes is refused
    core.handle(m.Commit([slot], [key(0)]))  # A's late commit
    core.handle(m.Abort([slot], [key(0)]))  # and a stale abort: neither touches B's reservation
    assert core.writing[slot][0] == key(4)
    arena.data(slot)[:] = block(4)
    assert arena.end_write(slot, key(4), SLOT, b_gen) is True
    core.handle(m.Commit([slot], [key(4)]))
    assert core.by_key[key(4)] == slot and key(0) not in core.by_key
    assert arena.read(slot, key(4)) == block(4).tobytes()


def test_read_scatter_fills_every_part_or_reports_failure(arena: Arena) -> None:
    arena.write(0, key(0), block(0))
    parts = [np.zeros(SLOT // 4, dtype=np.uint8) for _ in range(4)]
    assert arena.read_scatter(0, key(0), parts)
    assert np.concatenate(parts).tobytes() == block(0).tobytes()
    assert not arena.read_scatter(0, key(1), parts)  # another key
    arena.data(0)[5] ^= 1
    assert not arena.read_scatter(0, key(0), parts)  # a corrupt byte
    arena.write(1, key(1), block(1))
    real_data = arena.data

    def data_then_overwrite(slot: int) -> np.ndarray:
        view = real_data(slot)
        arena.data = real_data  # type: ignore[method-assign]
        arena.write(1, key(2), block(2))  # reused after the checksum passed, before the copy ended
        return view

    arena.data = data_then_overwrite  # type: ignore[method-assign]
    assert not arena.read_scatter(1, key(1), parts)


def test_a_session_s_next_turn_replaces_its_pins_and_its_old_tail_goes_first(tmp_path: Path) -> None:
    clock = Clock()
    core = TierCore(Arena.create(tmp_path / "t6", SLOT, 6, FP), clock=clock, tenant_pin_share=1.0)
    for i in range(4):
        put(core, i)
    # turn 1 of session s pins blocks 0..3; turn 2 shares 0..1 and goes on with 4 instead
    assert core.handle(m.Pin([key(i) for i in range(4)], 60.0, owner="s", tenant="t")) == m.Pinned(4)
    put(core, 4)
    assert core.handle(m.Pin([key(0), key(1), key(4)], 60.0, owner="s", tenant="t")) == m.Pinned(3)
    put(core, 5)  # the tier is full now: 0, 1, 4 pinned; 2 and 3 (the superseded tail) demoted
    put(core, 6)
    put(core, 7)
    assert held(core, range(8)) == [0, 1, 4, 5, 6, 7]  # the old tail left first, before the LRU's 5
    stats = core.stats()
    assert (stats.demoted, stats.evictions) == (2, {"lru": 2})
    found = core.handle(m.Lookup([key(0), key(1)]))
    assert isinstance(found, m.Found) and len(found.slots) == 2 and core.stats().pinned_hits == 2


def test_one_tenant_pins_no_more_than_its_share_and_expiry_gives_the_budget_back(arena: Arena) -> None:
    clock = Clock()
    core = TierCore(arena, clock=clock, tenant_pin_share=0.5)  # 4 slots: 2 each
    for i in range(4):
        put(core, i)
    got = core.handle(m.Pin([key(0), key(1), key(2)], 60.0, owner="a1", tenant="A"))
    assert got == m.Pinned(2, refused=1)  # the prompt's leading blocks first
    assert core.handle(m.Pin([key(3)], 60.0, owner="a2", tenant="A")) == m.Pinned(0, refused=1)
    assert core.handle(m.Pin([key(3)], 60.0, owner="b1", tenant="B")) == m.Pinned(1)  # another tenant's own
    clock.t += 61
    core.reclaim()  # the server's once-a-second sweep
    assert core.handle(m.Pin([key(2)], 60.0, owner="a2", tenant="A")) == m.Pinned(1)
    assert core.stats().pins_refused == 2


def test_a_pinned_block_that_leaves_frees_its_tenant_s_budget(arena: Arena) -> None:
    core = TierCore(arena, tenant_pin_share=0.5)
    for i in range(2):
        put(core, i)
    assert core.handle(m.Pin([key(0), key(1)], 60.0, owner="a1", tenant="A")) == m.Pinned(2)
    core.handle(m.Forget([key(0)], "corrupt"))
    put(core, 2)
    assert core.handle(m.Pin([key(2)], 60.0, owner="a2", tenant="A")) == m.Pinned(1)


def test_a_shorter_re_pin_shortens_the_pin_so_the_budget_it_frees_is_real(arena: Arena) -> None:
    clock = Clock()
    core = TierCore(arena, clock=clock, tenant_pin_share=0.5)  # 4 slots: 2 per tenant
    for i in range(4):
        put(core, i)
    assert core.handle(m.Pin([key(0), key(1)], 3600.0, owner="s1", tenant="A")) == m.Pinned(2)
    assert core.handle(m.Pin([key(0), key(1)], 1.0, owner="s1", tenant="A")) == m.Pinned(2)
    clock.t += 2
    core.reclaim()
    assert core.handle(m.Pin([key(2), key(3)], 3600.0, owner="s2", tenant="A")) == m.Pinned(2)
    assert core.policy.pinned(clock.t) == 2  # 0 and 1 are no longer pinned: A holds its share, no more


def test_a_slot_two_sessions_pin_stays_pinned_until_both_let_go(arena: Arena) -> None:
    clock = Clock()
    core = TierCore(arena, clock=clock, tenant_pin_share=1.0)
    for i in range(4):
        put(core, i)
    core.handle(m.Pin([key(0), key(1)], 60.0, owner="parent", tenant="A"))
    core.handle(m.Pin([key(0), key(2)], 60.0, owner="fork", tenant="A"))  # shares the prefix block 0
    core.handle(m.Pin([key(3)], 60.0, owner="parent", tenant="A"))  # the parent moves on
    assert core.policy.is_pinned(core.by_key[key(0)], clock.t)  # the fork still keeps block 0
    assert not core.policy.is_pinned(core.by_key[key(1)], clock.t)
    assert core.stats().demoted == 1  # only block 1, which nobody pins any more


def put_cold(core: TierCore, ids: list[int]) -> None:
    """A finished request's blocks, which its engine keeps cached (``Reserve(cold=True)``)."""
    reserved = core.handle(m.Reserve([key(i) for i in ids], cold=True))
    assert isinstance(reserved, m.Reserved)
    mine = [(slot, i) for slot, i in zip(reserved.slots, ids, strict=True) if slot >= 0]
    for slot, i in mine:
        core.arena.write(slot, key(i), block(i))
    core.handle(m.Commit([s for s, _ in mine], [key(i) for _, i in mine]))


def test_copies_an_engine_still_holds_leave_before_the_tier_s_only_copies(arena: Arena) -> None:
    core = TierCore(arena)
    put(core, 0)  # evicted by an engine: the tier's copy is the only one
    put(core, 1)
    put_cold(core, [2, 3])  # a chain an engine still holds: spares, its tail leaving first
    put(core, 4)
    assert held(core, range(5)) == [0, 1, 2, 4]
    put(core, 5)
    assert held(core, range(6)) == [0, 1, 4, 5]
    # A cold store of a held block keeps its place; an engine evicting it refreshes it.
    put_cold(core, [0])
    put(core, 1)
    put(core, 6)
    assert held(core, range(7)) == [1, 4, 5, 6]


def test_the_oldest_spares_leave_first_and_a_hit_takes_one_back(arena: Arena) -> None:
    core = TierCore(arena)
    put_cold(core, [0])  # request A ended
    put_cold(core, [1, 2])  # request B ended later: its chain is the fresher spare
    put(core, 3)  # the tier is full now
    put(core, 4)
    assert held(core, range(5)) == [1, 2, 3, 4]  # A's spare, the oldest, left first
    put(core, 5)
    assert held(core, range(6)) == [1, 3, 4, 5]  # then B's tail
    core.handle(m.Lookup([key(1)]))  # another engine wants B's head: no longer a spare
    put(core, 6)
    assert held(core, range(7)) == [1, 4, 5, 6]  # no spare left: the least recently used, 3


def test_blocks_an_engine_loaded_become_spares_and_a_hit_chain_s_head_stays_longest(arena: Arena) -> None:
    core = TierCore(arena)
    for i in range(4):
        put(core, i)
    core.handle(m.Lookup([key(0), key(1), key(2), key(3)]))  # one chain: its head refreshed last
    put(core, 4)
    assert held(core, range(5)) == [0, 1, 2, 4]  # the tail left, not the head
    core.handle(m.Demote([key(1), key(2)]))  # an engine loaded them: its copies are the ones in use
    put(core, 5)
    put(core, 6)
    assert held(core, range(7)) == [0, 4, 5, 6]
    assert core.stats().evictions == {"lru": 3}


def test_a_store_never_evicts_a_block_of_its_own_chain(arena: Arena) -> None:
    """Under pressure, a finished request's cold store of a held shared prefix plus its own new block
    evicts something else, not the prefix's last block (the oldest spare left): the prefix stays whole
    for the next node."""
    core = TierCore(arena)
    put(core, 0)  # the tier's only copy of some other block
    put_cold(core, [1, 2, 3])  # request A computed a prefix: spares, its tail (3) the oldest
    # request B (same prefix, another task) ends on A's node: its chain is the prefix and block 4
    reserved = core.handle(m.Reserve([key(1), key(2), key(3), key(4)], cold=True))
    assert isinstance(reserved, m.Reserved) and reserved.slots[:3] == [-1, -1, -1] and reserved.slots[3] >= 0
    assert held(core, range(5)) == [1, 2, 3]  # block 0 left, the prefix stayed whole
    # When only the request's own blocks are left to evict, the new block is not stored.
    core.handle(m.Abort([reserved.slots[3]], [key(4)]))
    put_cold(core, [5])
    assert core.handle(m.Reserve([key(1), key(2), key(3), key(5), key(6)], cold=True)) == m.Reserved(
        [-1, -1, -1, -1, -1]
    )
    assert held(core, range(7)) == [1, 2, 3, 5]


def test_pinned_blocks_of_the_storing_request_are_not_its_victims(arena: Arena) -> None:
    clock = Clock()
    core = TierCore(arena, clock=clock, tenant_pin_share=1.0)
    for i in range(4):
        put(core, i)
    core.handle(m.Pin([key(0)], 10.0, owner="s1", tenant="A"))  # expires first
    core.handle(m.Pin([key(1), key(2), key(3)], 60.0, owner="s2", tenant="A"))
    reserved = core.handle(m.Reserve([key(0), key(4)]))  # everything pinned; block 0 is this chain's
    assert isinstance(reserved, m.Reserved) and reserved.slots[1] >= 0
    assert key(0) in core.by_key and core.stats().evictions == {"pinned_lru": 1}


def test_a_pinned_spare_leaves_before_the_only_copies_and_its_pin_returns_with_the_block(arena: Arena) -> None:
    """A session's pinned context that its engine still holds is a duplicate: under pressure it leaves
    before the tier's only copies, and when the engine evicts the block (stored again, hot) the pin is
    back, still counted against the tenant."""
    clock = Clock()
    core = TierCore(arena, clock=clock, tenant_pin_share=1.0)
    put(core, 0)
    put(core, 1)  # only copies of other blocks
    put_cold(core, [2, 3])  # the session's turn ended: its engine keeps the blocks
    assert core.handle(m.Pin([key(2), key(3)], 60.0, owner="s", tenant="A")) == m.Pinned(2, 0)
    put(core, 4)  # pressure: the pinned spare's tail goes, not the only copies 0 and 1
    assert held(core, range(5)) == [0, 1, 2, 4]
    assert core.stats().evictions == {"pinned_spare": 1} and core.tenant_pins["A"] == 2
    put(core, 3)  # the engine evicted block 3: stored again, its pin with it
    assert held(core, range(5)) == [0, 1, 3, 4]  # (block 2, a pinned spare still, made the room)
    assert core.policy.is_pinned(core.by_key[key(3)], clock.t)
    put(core, 5)
    put(core, 6)
    # pinned and now the only copy: it stays while the unpinned ones go
    assert held(core, range(7)) == [3, 4, 5, 6] and core.tenant_pins["A"] == 2
    # the TTL ends: the pin and its budget are gone
    clock.t += 61
    core.reclaim()
    assert core.tenant_pins["A"] == 0 and not core.key_owners
