"""Subscribers on real ZeroMQ sockets: vLLM's own ZmqEventPublisher fed by vLLM's BlockPool, and a
publisher in vLLM's wire format that drops, forgets and restarts on demand."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import zmq.asyncio
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher

from contracts.registry import LiveNode, NodeInfo, NodeLoad, Role
from router.kv_index.block_keys import BlockHasher, BlockKey
from router.kv_index.index import FleetIndex
from router.kv_index.subscriber import KVEventSubscriber, KVEventSubscribers
from tests.support.vllm_helpers import EnginePrefixCache
from tests.support.zmq_helpers import FakePublisher, stored, until

BS = 16


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49_152) for _ in range(n)]


def _k(*ks: int) -> list[BlockKey]:
    return [BlockKey(k) for k in ks]


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def _eps(tmp_path: Path, name: str = "n") -> tuple[str, str]:
    return f"ipc://{tmp_path}/{name}-ev", f"ipc://{tmp_path}/{name}-rp"


async def test_vllm_publisher_history_live_eviction_and_restart(
    tmp_path: Path, ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    ev_ep, rp_ep = _eps(tmp_path)
    hasher = BlockHasher(BS, "sha256_cbor")
    engine = EnginePrefixCache(BS, "sha256_cbor", num_blocks=64)
    pub = ZmqEventPublisher(0, endpoint=ev_ep, replay_endpoint=rp_ep)

    def publish(p: ZmqEventPublisher, events: list) -> None:
        p.publish(KVEventBatch(ts=time.time(), events=events))

    turn1 = _tokens(6 * BS + 3, seed=1)
    _, blocks1 = engine.store(turn1)
    publish(pub, engine.take_events())  # before the router subscribes: only the replay has it

    fleet = FleetIndex()
    sub = KVEventSubscriber(fleet.model("m", BS), "p0", ev_ep, rp_ep, ctx=ctx, hasher=hasher)
    sub.start()
    try:
        await until(lambda: fleet.longest_prefix("m", hasher.keys(turn1)) == {"p0": 6}, what="history")
        deadline = time.monotonic() + 15
        while sub.stats.live_batches == 0 and time.monotonic() < deadline:  # PUB/SUB joins late
            publish(pub, [])
            await asyncio.sleep(0.05)

        turn2 = turn1 + _tokens(4 * BS, seed=2)  # the chat grows
        _, blocks2 = engine.store(turn2, prefix_blocks=blocks1[:6])
        publish(pub, engine.take_events())
        await until(lambda: fleet.longest_prefix("m", hasher.keys(turn2)) == {"p0": 10}, what="turn 2")

        for _ in range(40):  # push the seq well past what a restarted engine will send
            publish(pub, [])
        await until(lambda: sub.expected is not None and sub.expected > 40, what="seq 40")

        # the engine restarts: a new publisher counts from 0 and the old blocks are gone
        pub.shutdown()
        engine = EnginePrefixCache(BS, "sha256_cbor", num_blocks=64)
        pub = ZmqEventPublisher(0, endpoint=ev_ep, replay_endpoint=rp_ep)
        turn3 = _tokens(3 * BS, seed=3)
        _, blocks3 = engine.store(turn3)
        publish(pub, engine.take_events())
        deadline = time.monotonic() + 15
        while not sub.stats.restarts and time.monotonic() < deadline:  # until the SUB has reconnected
            publish(pub, [])
            await asyncio.sleep(0.05)
        await until(lambda: fleet.longest_prefix("m", hasher.keys(turn3)) == {"p0": 3}, what="turn 3")
        assert fleet.longest_prefix("m", hasher.keys(turn2)) == {}
        assert sub.stats.restarts == 1

        # eviction and a prefix-cache reset, as the engine reports them
        engine.free(blocks3)
        assert engine.pool.reset_prefix_cache()
        events = engine.take_events()
        assert isinstance(events[-1], AllBlocksCleared)
        publish(pub, events)
        await until(lambda: fleet.longest_prefix("m", hasher.keys(turn3)) == {}, what="cleared")
        assert sub.stats.key_mismatches == 0
        assert sub.stats.decode_errors == 0
    finally:
        await sub.stop()
        pub.shutdown()


async def test_gap_is_replayed_and_live_copies_skipped(tmp_path: Path, ctx: zmq.asyncio.Context) -> None:
    ev_ep, rp_ep = _eps(tmp_path)
    pub = FakePublisher(ctx, ev_ep, rp_ep)
    fleet = FleetIndex()
    sub = KVEventSubscriber(fleet.model("m", BS), "p0", ev_ep, rp_ep, ctx=ctx)
    sub.start()
    try:
        await pub.connected(lambda: sub.stats.live_batches > 0)
        pub.publish([stored([1, 2])])
        pub.publish([stored([3], parent=2)], drop=True)  # lost on the wire
        gap_seq = pub.seq
        pub.publish([stored([4], parent=3)])
        pub.publish([stored([5], parent=4)])  # buffered before the replay is asked for
        await until(lambda: fleet.longest_prefix("m", _k(1, 2, 3, 4, 5)) == {"p0": 5}, what="replayed gap")
        assert gap_seq - 1 in pub.replay_requests
        await until(lambda: sub.stats.duplicates >= 1, what="live copy of a replayed batch")
        assert sub.stats.gaps >= 1
        assert sub.stats.lost == 0
        assert sub.stats.restarts == 0
    finally:
        await sub.stop()
        await pub.close()


async def test_unrecoverable_gap_forgets_the_node(tmp_path: Path, ctx: zmq.asyncio.Context) -> None:
    ev_ep, rp_ep = _eps(tmp_path)
    pub = FakePublisher(ctx, ev_ep, rp_ep)
    fleet = FleetIndex()
    sub = KVEventSubscriber(fleet.model("m", BS), "p0", ev_ep, rp_ep, ctx=ctx)
    sub.start()
    try:
        await pub.connected(lambda: sub.stats.live_batches > 0)
        pub.publish([stored([1, 2])])
        await until(lambda: fleet.longest_prefix("m", _k(1, 2)) == {"p0": 2})
        lost = pub.publish([stored([9])], drop=True)
        del pub.buffer[lost]  # the ring buffer no longer has it (e.g. a BlockRemoved for 1, 2)
        pub.publish([stored([7, 8])])
        await until(lambda: fleet.longest_prefix("m", _k(7, 8)) == {"p0": 2}, what="after the gap")
        assert fleet.longest_prefix("m", _k(1, 2)) == {}  # no stale hits from before the gap
        assert sub.stats.lost == 1
    finally:
        await sub.stop()
        await pub.close()


@pytest.mark.parametrize("replay", ["none", "silent"])
async def test_gap_without_replay_forgets_the_node(tmp_path: Path, ctx: zmq.asyncio.Context, replay: str) -> None:
    ev_ep, rp_ep = _eps(tmp_path)
    pub = FakePublisher(ctx, ev_ep, rp_ep if replay == "silent" else None, answer=False)
    fleet = FleetIndex()
    sub = KVEventSubscriber(
        fleet.model("m", BS),
        "p0",
        ev_ep,
        rp_ep if replay == "silent" else None,
        ctx=ctx,
        replay_timeout_s=0.3,
    )
    sub.start()
    try:
        await pub.connected(lambda: sub.stats.live_batches > 0)
        pub.publish([stored([1, 2])])
        await until(lambda: fleet.longest_prefix("m", _k(1, 2)) == {"p0": 2})
        pub.publish([stored([3])], drop=True)
        pub.publish([stored([4])])
        await until(lambda: fleet.longest_prefix("m", _k(4)) == {"p0": 1}, what="after the gap")
        assert fleet.longest_prefix("m", _k(1, 2)) == {}
        assert sub.stats.lost >= 1
    finally:
        await sub.stop()
        await pub.close()


async def test_restart_and_all_blocks_cleared(tmp_path: Path, ctx: zmq.asyncio.Context) -> None:
    ev_ep, rp_ep = _eps(tmp_path)
    pub = FakePublisher(ctx, ev_ep, rp_ep)
    fleet = FleetIndex()
    sub = KVEventSubscriber(fleet.model("m", BS), "p0", ev_ep, rp_ep, ctx=ctx)
    sub.start()
    try:
        await pub.connected(lambda: sub.stats.live_batches > 0)
        pub.publish([stored([1, 2])])
        await until(lambda: fleet.longest_prefix("m", _k(1, 2)) == {"p0": 2})
        pub.publish([AllBlocksCleared(), stored([5])])
        await until(lambda: fleet.longest_prefix("m", _k(5)) == {"p0": 1})
        assert fleet.longest_prefix("m", _k(1, 2)) == {}

        pub.seq = 0  # the engine restarted: seq counts from 0 again, its cache is empty
        pub.buffer.clear()
        pub.publish([stored([6])])
        await until(lambda: fleet.longest_prefix("m", _k(6)) == {"p0": 1}, what="after restart")
        assert fleet.longest_prefix("m", _k(5)) == {}
        assert sub.stats.restarts == 1
    finally:
        await sub.stop()
        await pub.close()


def _node(node_id: str, ev: str, rp: str, *, model: str = "m", started_at: float = 1.0) -> LiveNode:
    info = NodeInfo(
        node_id=node_id,
        role=Role.PREFILL,
        model=model,
        url="http://127.0.0.1:1",
        block_size=BS,
        max_model_len=8192,
        kv_connector="none",
        kv_events_endpoint=ev,
        kv_replay_endpoint=rp,
        started_at=started_at,
    )
    return LiveNode(info=info, load=NodeLoad())


async def test_manager_follows_the_registry(tmp_path: Path, ctx: zmq.asyncio.Context) -> None:
    ev_a, rp_a = _eps(tmp_path, "a")
    ev_b, rp_b = _eps(tmp_path, "b")
    pub_a = FakePublisher(ctx, ev_a, rp_a)
    pub_b = FakePublisher(ctx, ev_b, rp_b)
    pub_a.publish([stored([1, 2])])  # history: reaches the index through the replay
    pub_b.publish([stored([1])])
    fleet = FleetIndex()
    subs = KVEventSubscribers(fleet, ctx=ctx)
    try:
        await subs.sync([_node("a", ev_a, rp_a), _node("b", ev_b, rp_b)])
        await until(lambda: fleet.longest_prefix("m", _k(1, 2)) == {"a": 2, "b": 1})

        await subs.sync([_node("a", ev_a, rp_a)])  # b left the registry
        assert subs.subscriber("b") is None
        assert fleet.longest_prefix("m", _k(1, 2)) == {"a": 2}

        first = subs.subscriber("a")
        await subs.sync([_node("a", ev_a, rp_a, started_at=2.0)])  # a restarted: fresh subscriber
        assert subs.subscriber("a") is not first
        await until(lambda: fleet.longest_prefix("m", _k(1, 2)) == {"a": 2}, what="resubscribed")
        assert set(subs.stats()) == {"a"}
    finally:
        await subs.close()
        await pub_a.close()
        await pub_b.close()
    assert fleet.block_counts() == {"m": {}}


async def test_a_node_hashing_differently_is_reported(tmp_path: Path, ctx: zmq.asyncio.Context) -> None:
    ev_ep, rp_ep = _eps(tmp_path)
    pub = FakePublisher(ctx, ev_ep, rp_ep)
    fleet = FleetIndex()
    router_hasher = BlockHasher(BS, "sha256_cbor")
    sub = KVEventSubscriber(fleet.model("m", BS), "p0", ev_ep, rp_ep, ctx=ctx, hasher=router_hasher)
    sub.start()
    try:
        await pub.connected(lambda: sub.stats.live_batches > 0)
        tokens = _tokens(2 * BS, seed=9)
        good = stored(router_hasher.keys(tokens))
        good.token_ids = tokens
        bad_keys = BlockHasher(BS, "sha256_cbor", seed="1234").keys(tokens)  # node with PYTHONHASHSEED
        bad = stored(bad_keys)
        bad.token_ids = tokens
        pub.publish([good, bad])
        await until(lambda: sub.stats.events >= 2, what="both events")
        assert sub.stats.key_mismatches == 1
    finally:
        await sub.stop()
        await pub.close()


def test_unknown_event_types_are_skipped_not_fatal() -> None:
    import msgspec

    from router.kv_index.events import BlockStored, decode_batch

    payload = msgspec.msgpack.encode(
        [
            1.0,
            [{"type": "BlockPinned", "x": 1}, {"type": "BlockStored", "block_hashes": [3], "block_size": 16}],
        ]
    )
    batch = decode_batch(payload)
    assert batch.skipped == 1
    assert isinstance(batch.events[0], BlockStored) and batch.events[0].block_hashes == [3]


async def test_a_tier_snapshot_covers_the_live_batches_still_queued_behind_it() -> None:
    """A snapshot (a replay opening with AllBlocksCleared, as a host tier answers) stands for every batch
    up to its seq: the live copies of those still queued on the SUB socket are duplicates, not a
    restart (each false restart would clear the tier's blocks and fetch another snapshot)."""
    from host_tier.events import EventPublisher

    class Recorder(EventPublisher):  # the tier's own encoder, no socket: batches kept as published
        def __init__(self) -> None:
            super().__init__(zmq.asyncio.Context.instance(), None, BS)
            self._sock = object()  # type: ignore[assignment]
            self.sent: list[tuple[int, bytes]] = []

        def flush(self, *, heartbeat_s: float | None = None) -> None:
            if not self._events:
                return
            from host_tier.events import _Batch

            self.sent.append((self._seq, self._enc.encode(_Batch(ts=0.0, events=self._events))))
            self._events = []
            self._seq += 1

    pub = Recorder()
    keys = [bytes([i]) * 32 for i in range(30)]
    for k in keys[:10]:
        pub.stored([k])
        pub.flush()
    index = FleetIndex().model("m", BS)
    index.add_tier("tier@h")
    ctx = zmq.asyncio.Context()
    sub = KVEventSubscriber(index, "tier@h", "ipc:///nonexistent-ev", "ipc:///nonexistent-rp", ctx=ctx)
    replays = 0

    async def replay(start: int) -> list[tuple[int, bytes]]:
        nonlocal replays
        replays += 1
        return pub.replay(start, keys[:10])

    sub._request_replay = replay  # type: ignore[method-assign]
    try:
        await sub._catch_up(0)
        for seq, payload in pub.sent[3:10]:  # live batches that were queued before the snapshot
            await sub._on_live(seq, payload)
        assert (replays, sub.stats.restarts, sub.stats.lost) == (1, 0, 0)
        assert index.block_counts()["tier@h"] == 10
    finally:
        ctx.destroy(linger=0)


def test_only_a_node_on_this_host_has_a_tier_the_router_can_hear() -> None:
    from router.kv_index.subscriber import tier_id

    def info(url: str) -> NodeInfo:
        return NodeInfo(
            node_id="n",
            role=Role.BOTH,
            model="m",
            url=url,
            block_size=BS,
            max_model_len=4096,
            kv_connector="none",
            host_tier_events_endpoint="ipc:///tmp/tandem-tier-events.sock",
        )

    assert tier_id(info("http://127.0.0.1:8100")) == "tier@127.0.0.1:ipc:///tmp/tandem-tier-events.sock"
    # another host's ipc path would name this host's tier: not attached (no tier hits predicted: safe)
    assert tier_id(info("http://203.0.113.7:8100")) is None
