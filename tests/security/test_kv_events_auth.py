"""KV events leave a host only encrypted and only to the cluster (issue 13): a node on a real interface
keeps vLLM's publisher and replay socket on ipc, and its agent's CURVE relay
(``node_agent.kv_events_relay``) serves them on TCP to holders of the cluster secret. Real parts: vLLM's
own ZmqEventPublisher with vLLM's BlockPool events, the relay, and the router's subscriber."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

from bench.standin_engine import free_port
from contracts.secret import curve_keys
from node_agent.kv_events_relay import END_SEQ, KVEventsRelay
from router.kv_index.block_keys import BlockHasher
from router.kv_index.index import FleetIndex
from router.kv_index.subscriber import CurveClient, KVEventSubscriber
from tests.support.vllm_helpers import EnginePrefixCache
from tests.support.zmq_helpers import until

BS = 16
SECRET = b"k" * 32
KEYS = curve_keys(SECRET)


class Node:
    def __init__(self, tmp_path: Path) -> None:
        self.engine_events, self.engine_replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
        self.events, self.replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        self.pub = ZmqEventPublisher(0, endpoint=self.engine_events, replay_endpoint=self.engine_replay)
        self.relay = KVEventsRelay(
            engine_events=self.engine_events,
            engine_replay=self.engine_replay,
            events_bind=self.events,
            replay_bind=self.replay,
            keys=KEYS,
        )
        self.relay.start()
        self.cache = EnginePrefixCache(BS, "sha256_cbor", num_blocks=64)

    def store(self, tokens: list[int]) -> None:
        self.cache.store(tokens)
        self.pub.publish(KVEventBatch(ts=time.time(), events=self.cache.take_events()))

    def close(self) -> None:
        self.relay.close()
        self.pub.shutdown()


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    n = Node(tmp_path)
    yield n
    n.close()


def _client(ctx: zmq.Context, kind: int, endpoint: str, keys: object | None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.linger = 0
    if keys is not None:
        sock.curve_serverkey = KEYS.server_public
        sock.curve_publickey = keys.client_public  # type: ignore[attr-defined]
        sock.curve_secretkey = keys.client_secret  # type: ignore[attr-defined]
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


async def test_the_router_gets_a_relayed_nodes_history_and_live_events_with_the_cluster_keys(node: Node) -> None:
    tokens = list(range(1000, 1000 + 5 * BS))
    node.store(tokens)  # before the router subscribes: only the (relayed) replay has it
    hasher = BlockHasher(BS, "sha256_cbor")
    fleet = FleetIndex()
    ctx = zmq.asyncio.Context()
    sub = KVEventSubscriber(
        fleet.model("m", BS),
        "n0",
        node.events,
        node.replay,
        ctx=ctx,
        hasher=hasher,
        curve=CurveClient(KEYS.server_public, KEYS.client_public, KEYS.client_secret),
    )
    sub.start()
    try:
        await until(lambda: fleet.longest_prefix("m", hasher.keys(tokens)) == {"n0": 5}, what="history")
        more = tokens + list(range(5000, 5000 + 3 * BS))
        node.store(more)
        deadline = time.monotonic() + 30
        while fleet.longest_prefix("m", hasher.keys(more)) != {"n0": 8}:
            # PUB/SUB joins late: a later batch's seq shows the gap, and the (relayed) replay fills it.
            assert time.monotonic() < deadline, "live events never arrived through the relay"
            node.pub.publish(KVEventBatch(ts=time.time(), events=[]))
            await asyncio.sleep(0.05)
        assert sub.stats.live_batches > 0
        assert node.relay.replays >= 1
    finally:
        await sub.stop()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("who", ["no keys", "another cluster's keys"])
def test_anyone_without_the_cluster_secret_gets_no_event_and_no_replay(node: Node, who: str) -> None:
    ctx = zmq.Context()
    keys = None if who == "no keys" else curve_keys(b"x" * 32)
    try:
        good_sub = _client(ctx, zmq.SUB, node.events, KEYS)
        bad_sub = _client(ctx, zmq.SUB, node.events, keys)
        deadline = time.monotonic() + 30
        i = 0
        while not good_sub.poll(100):  # the cluster's own subscriber is the clock: once it has events,
            assert time.monotonic() < deadline  # an outsider connected as long would have them too
            i += 1
            node.store(list(range(i * 100, i * 100 + BS)))
        assert good_sub.recv_multipart()[0] == b""  # vLLM's default topic
        node.store(list(range(90_000, 90_000 + BS)))
        assert good_sub.poll(5000)
        assert not bad_sub.poll(500), f"{who}: a KV event reached a subscriber outside the cluster"

        good = _client(ctx, zmq.DEALER, node.replay, KEYS)
        bad = _client(ctx, zmq.DEALER, node.replay, keys)
        bad.send_multipart([b"", (0).to_bytes(8, "big")])
        good.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while good.poll(5000):
            replies.append(good.recv_multipart())
            if replies[-1][2] == END_SEQ:
                break
        assert len(replies) > 1 and replies[-1][2] == END_SEQ  # the buffered batches, then the end
        assert not bad.poll(500), f"{who}: a replay answered a client outside the cluster"
        assert node.relay.replays == 1  # the outsider's request never reached the relay
    finally:
        ctx.destroy(linger=0)
