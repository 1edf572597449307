"""The node registry against the real Redis: register, heartbeat, lapse, deregister."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from contracts.errors import StoreError
from contracts.registry import NODES_SET, NodeInfo, NodeLoad, NodeRegistry, Role


def _info(node_id: str, role: Role = Role.PREFILL) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=role,
        model="m",
        url="http://127.0.0.1:1",
        block_size=16,
        max_model_len=2048,
        kv_connector="nixl",
    )


@pytest.fixture
async def registry(redis_unit_url: str):
    client = aioredis.from_url(redis_unit_url)
    await client.delete(NODES_SET)
    yield NodeRegistry(client, ttl_s=0.5)
    await client.flushdb()
    await client.aclose()


async def test_register_lists_node_with_its_load(registry: NodeRegistry) -> None:
    await registry.register(_info("a"), NodeLoad(running=3, waiting=2, kv_usage=0.5))
    [node] = await registry.live_nodes()
    assert node.info == _info("a")
    assert (node.load.running, node.load.waiting, node.load.kv_usage) == (3, 2, 0.5)


async def test_lapsed_heartbeat_drops_node_and_prunes_set(registry: NodeRegistry) -> None:
    await registry.register(_info("alive"))
    await registry.register(_info("dying", Role.DECODE))
    deadline = time.monotonic() + 5
    ids: set[str] = {"dying"}
    while "dying" in ids and time.monotonic() < deadline:
        await registry.heartbeat(_info("alive"), NodeLoad())  # only one node keeps beating
        ids = {n.info.node_id for n in await registry.live_nodes()}
        await asyncio.sleep(0.1)
    assert ids == {"alive"}
    members = await registry._redis.smembers(NODES_SET)  # noqa: SLF001 - checking the pruning itself
    assert members == {b"alive"}


async def test_deregister_removes_at_once(registry: NodeRegistry) -> None:
    await registry.register(_info("a"))
    await registry.deregister("a")
    assert await registry.live_nodes() == []


async def test_unreachable_redis_raises_store_error() -> None:
    client = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    with pytest.raises(StoreError):
        await NodeRegistry(client).live_nodes()
    await client.aclose()


async def test_a_v1_entry_without_epoch_still_decodes_with_epoch_0(registry: NodeRegistry) -> None:
    import msgspec

    from contracts.registry import node_key

    class NodeInfoV1(msgspec.Struct, kw_only=True):  # the v1 layout: no epoch field
        node_id: str
        role: str
        model: str
        url: str
        block_size: int
        max_model_len: int
        kv_connector: str
        schema_version: int = 1

    old = NodeInfoV1(
        node_id="v1",
        role="decode",
        model="m",
        url="http://127.0.0.1:1",
        block_size=16,
        max_model_len=2048,
        kv_connector="tandem",
    )
    await registry._redis.set(node_key("v1"), msgspec.msgpack.encode(old))  # noqa: SLF001 - an old writer
    await registry._redis.sadd(NODES_SET, "v1")  # noqa: SLF001
    [node] = await registry.live_nodes()
    assert node.info.node_id == "v1" and node.info.epoch == 0 and node.info.schema_version == 1


async def test_epochs_count_up_per_node_and_survive_deregistration(registry: NodeRegistry) -> None:
    assert [await registry.next_epoch("e") for _ in range(2)] == [1, 2]
    await registry.deregister("e")
    assert await registry.next_epoch("e") == 3
    assert await registry.next_epoch("other") == 1


async def test_a_stopped_nodes_status_leaves_soon_a_failed_ones_stays(registry: NodeRegistry) -> None:
    """An ended cluster leaves ``tandem cluster status`` by itself; a node that gave up stays visible."""
    from contracts.registry import STATUS_TTL_S, STOPPED_TTL_S, NodeState, NodeStatus, status_key

    await registry.set_status(NodeStatus(node_id="gone", state=NodeState.STOPPED))
    await registry.set_status(NodeStatus(node_id="sick", state=NodeState.UNHEALTHY))
    ttl = {n: await registry._redis.pttl(status_key(n, registry.cluster)) / 1000 for n in ("gone", "sick")}
    assert 0 < ttl["gone"] <= STOPPED_TTL_S < 600 and ttl["sick"] > STOPPED_TTL_S
    assert ttl["sick"] <= STATUS_TTL_S
