"""A node whose agent reports failed probes of its engine (a stopped or overloaded engine, not yet
counted as hung) stays in the router's view but out of routing while another node serves the model, and
is offered again when the others cannot serve the model without it (the only node, or a P/D fleet's only
prefill or decode node). Real Redis registry, the router's Fleet."""

from __future__ import annotations

import time
import uuid

import redis.asyncio as aioredis

from contracts.registry import NodeInfo, NodeLoad, NodeRegistry, Role
from router.fleet import Fleet


def _info(node_id: str, model: str, role: Role = Role.BOTH) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=role,
        model=model,
        url="http://127.0.0.1:1",
        block_size=16,
        max_model_len=8192,
        kv_connector="",
        started_at=1.0,
        epoch=1,
    )


async def test_a_node_with_failed_probes_is_routed_around_but_kept_in_view(redis_unit_url: str) -> None:
    model, tag = f"m-probes-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:6]
    well, unwell = f"well-{tag}", f"unwell-{tag}"
    registry = NodeRegistry(aioredis.from_url(redis_unit_url), ttl_s=60)
    fleet = Fleet(registry)
    try:
        await registry.register(_info(well, model))
        await registry.heartbeat(_info(unwell, model), NodeLoad(updated_at=time.time(), failed_probes=2))
        await fleet.refresh()
        assert {n.info.node_id for n in fleet.nodes} >= {well, unwell}  # still known (its index stays)
        assert [c.node_id for c in fleet.pools(model).colocated] == [well]

        await registry.deregister(well)  # the only node left has failed probes: offered, trying beats refusing
        await fleet.refresh()
        assert [c.node_id for c in fleet.pools(model).colocated] == [unwell]

        await registry.heartbeat(_info(unwell, model), NodeLoad(updated_at=time.time()))  # a probe answered
        await registry.register(_info(well, model))
        await fleet.refresh()
        assert sorted(c.node_id for c in fleet.pools(model).colocated) == sorted([well, unwell])
    finally:
        for n in (well, unwell):
            await registry.deregister(n)


async def test_a_p_d_fleets_only_prefill_node_with_failed_probes_is_kept(redis_unit_url: str) -> None:
    """Left out of routing only while the rest can still serve: without it, the decode node alone
    could answer nothing; beside a second, answering prefill node it is routed around."""
    model, tag = f"m-probes-pd-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:6]
    pre, dec, pre2 = f"pre-{tag}", f"dec-{tag}", f"pre2-{tag}"
    registry = NodeRegistry(aioredis.from_url(redis_unit_url), ttl_s=60)
    fleet = Fleet(registry)
    try:
        await registry.heartbeat(_info(pre, model, Role.PREFILL), NodeLoad(updated_at=time.time(), failed_probes=1))
        await registry.register(_info(dec, model, Role.DECODE))
        await fleet.refresh()
        pools = fleet.pools(model)
        assert [c.node_id for c in pools.prefill] == [pre] and [c.node_id for c in pools.decode] == [dec]

        await registry.register(_info(pre2, model, Role.PREFILL))
        await fleet.refresh()
        assert [c.node_id for c in fleet.pools(model).prefill] == [pre2]
        # a node a failed leg excluded is never offered back by this (a retry goes elsewhere or fails)
        assert [c.node_id for c in fleet.pools(model, exclude=frozenset({pre2})).prefill] == [pre]
    finally:
        for n in (pre, dec, pre2):
            await registry.deregister(n)
