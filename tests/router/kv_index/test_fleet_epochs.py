"""A node that comes back under the same id with a new epoch leaves nothing of its old incarnation in
the fleet KV index, even when the new engine has published nothing yet (an empty cache is silent).
Real Redis registry, the router's Fleet and subscribers, publishers on real ZeroMQ sockets."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import zmq.asyncio

from contracts.registry import NodeInfo, NodeRegistry, Role
from router.fleet import Fleet
from router.kv_index.block_keys import BlockKey
from router.kv_index.index import FleetIndex
from router.kv_index.subscriber import KVEventSubscribers
from tests.support.zmq_helpers import FakePublisher, stored, until


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def _info(node_id: str, ev: str, rp: str, epoch: int) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=Role.DECODE,
        model="m-epochs",
        url="http://127.0.0.1:1",
        block_size=16,
        max_model_len=8192,
        kv_connector="tandem",
        kv_events_endpoint=ev,
        kv_replay_endpoint=rp,
        started_at=1.0,
        epoch=epoch,
    )  # same started_at on purpose: only the epoch tells


async def test_a_new_epoch_drops_the_old_incarnations_blocks(
    tmp_path: Path, ctx: zmq.asyncio.Context, redis_unit_url: str
) -> None:
    node_id = f"epoch-{uuid.uuid4().hex[:8]}"
    ev, rp = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    client = aioredis.from_url(redis_unit_url)
    registry = NodeRegistry(client, ttl_s=60)
    index = FleetIndex()
    subs = KVEventSubscribers(index, ctx=ctx)
    fleet = Fleet(registry, on_refresh=subs.sync)
    keys = [BlockKey(11), BlockKey(12)]
    old = FakePublisher(ctx, ev, rp)
    old.publish([stored([11, 12])])
    try:
        await registry.register(_info(node_id, ev, rp, epoch=1))
        await fleet.refresh()
        await until(lambda: index.longest_prefix("m-epochs", keys).get(node_id) == 2, what="old blocks indexed")

        await old.close()  # the engine died; a new one binds the same endpoints and holds nothing yet
        new = FakePublisher(ctx, ev, rp)
        await registry.register(_info(node_id, ev, rp, epoch=2))
        await fleet.refresh()
        assert node_id not in index.longest_prefix("m-epochs", keys), "stale blocks of the old incarnation"
        assert index.block_counts().get("m-epochs", {}).get(node_id, 0) == 0
        assert fleet.epoch(node_id) == 2 and fleet.restarts[node_id] == 1

        new.publish([stored([21])])  # the new incarnation's own blocks do arrive
        await until(lambda: index.longest_prefix("m-epochs", [BlockKey(21)]).get(node_id) == 1, what="new blocks")
        await new.close()
    finally:
        await subs.close()
        await registry.deregister(node_id)
        await client.aclose()
