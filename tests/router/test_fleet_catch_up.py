"""A node that registered since the router's last registry read serves its first request at once
(``Fleet.catch_up``): what failed `tandem up`'s warm-up when the request reached the router replica that
had read the registry just before the node registered. Reads are single-flight and start at most once
per ``catch_up_s`` (a flood of unknown models costs Redis little).

The real Redis registry and the router's Fleet; the end-to-end case is the real router app over a
STAND-IN engine (``bench.standin_engine``)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from bench.standin_engine import ServerThread, StandInEngine
from contracts.registry import NodeInfo, NodeRegistry, Role
from router.fleet import Fleet
from tests.support.standin_cluster import deregister_nodes, register_nodes, standin_cluster


def _info(node_id: str, model: str, url: str = "http://127.0.0.1:1") -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=Role.BOTH,
        model=model,
        url=url,
        block_size=16,
        max_model_len=4096,
        kv_connector="none",
        started_at=1.0,
        epoch=1,
    )


class CountingRegistry(NodeRegistry):
    """The real registry, counting its reads (and able to hold one open, to overlap callers)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.started: list[float] = []
        self.gate: asyncio.Event | None = None

    @property
    def reads(self) -> int:
        return len(self.started)

    async def live_nodes(self):  # noqa: ANN201
        self.started.append(asyncio.get_running_loop().time())
        if self.gate is not None:
            await self.gate.wait()
        return await super().live_nodes()


async def test_catch_up_sees_a_node_registered_after_the_last_read(redis_unit_url: str) -> None:
    model, node = f"m-catch-{uuid.uuid4().hex[:6]}", f"late-{uuid.uuid4().hex[:6]}"
    registry = CountingRegistry(aioredis.from_url(redis_unit_url), ttl_s=60)
    fleet = Fleet(registry, refresh_s=60, catch_up_s=0.0)
    try:
        await fleet.refresh()
        assert model not in fleet.model_names
        await registry.register(_info(node, model))
        assert model not in fleet.model_names  # the periodic read is a minute away
        await fleet.catch_up()
        assert model in fleet.model_names
        assert [c.node_id for c in fleet.pools(model).colocated] == [node]
    finally:
        await registry.deregister(node)


async def test_catch_ups_share_reads_that_start_at_most_once_per_catch_up_s(redis_unit_url: str) -> None:
    registry = CountingRegistry(aioredis.from_url(redis_unit_url), ttl_s=60)
    fleet = Fleet(registry, refresh_s=60, catch_up_s=0.3)
    registry.gate = asyncio.Event()
    callers = [asyncio.create_task(fleet.catch_up()) for _ in range(20)]
    periodic = asyncio.create_task(fleet.refresh())
    await asyncio.sleep(0)  # every caller reaches the read under way
    callers[0].cancel()  # a client that leaves does not cancel the read the others wait on
    registry.gate.set()
    await asyncio.gather(*callers[1:], periodic)
    # The first caller's read started before the others asked: they share one more, which starts no
    # sooner than catch_up_s after the first.
    assert registry.reads == 2
    # (counted from when the fleet starts a read; the registry's clock starts a scheduling step later)
    assert registry.started[1] - registry.started[0] >= 0.25
    await fleet.refresh()  # the periodic read is not rate-limited
    assert registry.reads == 3


async def test_the_first_request_to_a_node_that_registered_after_the_router_read_is_served(tmp_path: Path) -> None:
    late_model = f"late-{uuid.uuid4().hex[:8]}"
    engine = StandInEngine(stream_tokens=4)
    async with standin_cluster(tmp_path, {"n": Role.BOTH}) as cl:  # the router reads every 60 s
        with ServerThread(engine.app) as engine_url:
            node = _info(f"late-{late_model}", late_model, engine_url)
            await register_nodes([node])
            try:
                async with httpx.AsyncClient(base_url=cl.url, timeout=30) as http:
                    body = {"model": late_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                    r = await http.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    assert r.json()["model"] == late_model
                    assert len(engine.bodies()) == 1
                    body["model"] = f"never-{late_model}"
                    r = await http.post("/v1/chat/completions", json=body)
                    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            finally:
                await deregister_nodes([node.node_id])
