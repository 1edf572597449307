"""The node agent's drain on SIGTERM (``drain_timeout_s``, node_agent/supervisor.py), the node half of a
Kubernetes pod's termination (infra/helm): deregister at once, let the engine finish its requests and its
KV leases end, then stop it; never longer than the setting. Real processes and the real Redis, with the
STAND-IN engine (tests/support/fake_engine.py ``--busy-until``: one request and one lease until a file
appears)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from contracts.registry import NodeInfo, NodeRegistry, epoch_key, status_key
from node_agent.engine_metrics import parse_metrics
from node_agent.node import EngineProcess, describe
from node_agent.supervisor import EngineSupervisor
from tests.node_agent.test_supervisor import fake_engine, fast_settings, until


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@asynccontextmanager
async def draining_agent(
    redis_url: str, idle_flag: Path, drain_timeout_s: float
) -> AsyncIterator[tuple[EngineSupervisor, NodeRegistry, asyncio.Event, asyncio.Task[int]]]:
    settings = fast_settings(redis_url, drain_timeout_s=drain_timeout_s, stall_timeout_s=120.0)
    client = aioredis.from_url(redis_url)
    registry = NodeRegistry(client, ttl_s=settings.registry_ttl_s)

    def new_engine() -> EngineProcess:
        return fake_engine(settings, "--busy-until", str(idle_flag))

    async def describe_fake(http: httpx.AsyncClient, epoch: int) -> NodeInfo:
        return await describe(settings, http, Path("/fake-model"), epoch)

    sup = EngineSupervisor(settings, registry, new_engine, describe_fake)
    stop = asyncio.Event()
    task = asyncio.create_task(sup.run(stop))
    try:
        yield sup, registry, stop, task
    finally:
        stop.set()
        await asyncio.to_thread(idle_flag.touch)
        await asyncio.wait_for(asyncio.shield(task), 30) if not task.done() else None
        await client.delete(status_key(settings.node_id), epoch_key(settings.node_id))
        await registry.deregister(settings.node_id)
        await client.aclose()


async def _registered(sup: EngineSupervisor, registry: NodeRegistry) -> bool:
    return any(n.info.node_id == sup.settings.node_id for n in await registry.live_nodes())


def test_the_lease_and_pull_gauges_are_read_with_the_engine_metrics() -> None:
    text = (
        'tandem_kv_leases_active{engine="0",model_name="m"} 2.0\ntandem_kv_leases_activ 9\nvllm:x 1\n'
        'tandem_kv_pulls_active{engine="0",model_name="m"} 1.0\ntandem_kv_pulls_active{engine="1"} 2.0\n'
    )
    snap = parse_metrics(text)
    assert snap.leases_active == 2 and snap.pulls_active == 3


async def test_stop_deregisters_at_once_and_stops_the_engine_only_when_it_has_drained(
    redis_unit_url: str, tmp_path: Path
) -> None:
    idle = tmp_path / "idle"
    async with draining_agent(redis_unit_url, idle, drain_timeout_s=60.0) as (sup, registry, stop, task):
        await until(lambda: _registered(sup, registry), 30, "registration")
        assert sup.engine is not None and sup.engine.pid is not None
        pid = sup.engine.pid
        stop.set()
        # Routers stop sending first: the entry goes while the engine still runs its request and lease.
        await until(lambda: _absent(sup, registry), 5, "deregistration")
        done, _ = await asyncio.wait({task}, timeout=1.5)  # five drain polls, far inside the 60 s drain
        assert not done and _alive(pid)
        async with httpx.AsyncClient() as http:
            snap = parse_metrics((await http.get(f"{sup.settings.url}/metrics")).text)
        assert snap.running == 1 and snap.leases_active == 1
        await asyncio.to_thread(idle.touch)  # the request finishes and the decode node has pulled: the lease ends
        assert await asyncio.wait_for(task, 30) == 0
        assert not _alive(pid)  # stop() returns once the engine's group is gone


async def test_the_drain_never_outlasts_its_timeout(redis_unit_url: str, tmp_path: Path) -> None:
    async with draining_agent(redis_unit_url, tmp_path / "never", drain_timeout_s=1.0) as (sup, registry, stop, task):
        await until(lambda: _registered(sup, registry), 30, "registration")
        loop = asyncio.get_running_loop()
        started = loop.time()
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0  # still busy and leased: stopped after the timeout
        assert 1.0 <= loop.time() - started < 1.0 + 20.0  # the drain, then at most the engine's stop window


async def _absent(sup: EngineSupervisor, registry: NodeRegistry) -> bool:
    return not await _registered(sup, registry)
