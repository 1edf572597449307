"""The node agent's engine supervision (node_agent/supervisor.py) on real processes and the real Redis: a
STAND-IN engine process (tests/support/fake_engine.py) is killed, stopped, left half-dead, or fails to
start; the agent deregisters it at once, restarts it under a new epoch, and gives up when it keeps
failing. The vLLM engine under the same supervision is covered by tests/e2e/test_supervision.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from contracts.errors import PortInUse, StoreError
from contracts.registry import NodeInfo, NodeRegistry, NodeState, Role, epoch_key, status_key
from node_agent.node import EngineProcess, describe
from node_agent.ports import port_free
from node_agent.settings import NodeSettings
from node_agent.supervisor import EXIT_UNHEALTHY, EngineSupervisor

ROOT = Path(__file__).resolve().parents[2]


def free_port_block() -> int:
    """A port P with P..P+3 free (the engine's HTTP and side ports)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 60000 and all(port_free("127.0.0.1", port + i) for i in range(4)):
            return port
    raise RuntimeError("no free block of 4 ports")


async def until(cond: Callable[[], Awaitable[bool]], within_s: float, what: str) -> None:
    """Poll state held by other processes (registry keys, process states) until it holds."""
    deadline = time.monotonic() + within_s
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_s} s waiting for {what}")
        await asyncio.sleep(0.05)


def fast_settings(redis_url: str, **kw: object) -> NodeSettings:
    base: dict[str, object] = dict(
        role=Role.BOTH,
        port=free_port_block(),
        node_id=f"sup-{uuid.uuid4().hex[:8]}",
        redis_url=redis_url,
        heartbeat_s=0.1,
        registry_ttl_s=120.0,  # a TTL far longer than any test: removal must be explicit
        restart_backoff_s=0.05,
        restart_backoff_max_s=0.2,
        health_timeout_s=0.5,
        health_failures=2,
        stall_timeout_s=1.0,
        startup_timeout_s=30.0,
        max_failures=5,
        failure_window_s=60.0,
    )
    base.update(kw)
    return NodeSettings(**base)  # type: ignore[arg-type]


def fake_engine(settings: NodeSettings, *args: str) -> EngineProcess:
    cmd = [sys.executable, "-m", "tests.support.fake_engine", "--port", str(settings.port), *args]
    return EngineProcess(settings, command=cmd, env={**os.environ, "PYTHONPATH": str(ROOT)})


class Agent:
    def __init__(
        self, settings: NodeSettings, registry: NodeRegistry, sup: EngineSupervisor, task: asyncio.Task[int]
    ) -> None:
        self.settings, self.registry, self.sup, self.task = settings, registry, sup, task

    async def registered(self) -> NodeInfo | None:
        for n in await self.registry.live_nodes():
            if n.info.node_id == self.settings.node_id:
                return n.info
        return None

    async def epoch_at_least(self, epoch: int) -> bool:
        info = await self.registered()
        return info is not None and info.epoch >= epoch

    def engine_pid(self) -> int:
        assert self.sup.engine is not None and self.sup.engine.pid is not None
        return self.sup.engine.pid


@asynccontextmanager
async def agent(
    redis_unit_url: str, engine_args: Callable[[int], list[str]] | None = None, **kw: object
) -> AsyncIterator[Agent]:
    """A supervisor running in this loop; ``engine_args(n)`` gives the stand-in's flags for start n."""
    settings = fast_settings(redis_unit_url, **kw)
    client = aioredis.from_url(redis_unit_url)
    registry = NodeRegistry(client, ttl_s=settings.registry_ttl_s)
    starts = 0

    def new_engine() -> EngineProcess:
        nonlocal starts
        starts += 1
        return fake_engine(settings, *(engine_args(starts) if engine_args else []))

    async def describe_fake(http: httpx.AsyncClient, epoch: int) -> NodeInfo:
        return await describe(settings, http, Path("/fake-model"), epoch)

    sup = EngineSupervisor(settings, registry, new_engine, describe_fake)
    stop = asyncio.Event()
    task = asyncio.create_task(sup.run(stop))
    try:
        yield Agent(settings, registry, sup, task)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.shield(task), 30) if not task.done() else None
        with contextlib.suppress(RedisError, StoreError):  # one test runs without a reachable Redis
            await client.delete(status_key(settings.node_id), epoch_key(settings.node_id))
            await registry.deregister(settings.node_id)
        await client.aclose()


async def test_a_killed_engine_is_deregistered_at_once_and_comes_back_with_a_new_epoch(redis_unit_url: str) -> None:
    async with agent(redis_unit_url) as a:
        await until(lambda: a.epoch_at_least(1), 30, "first registration")
        first = await a.registered()
        assert first is not None
        old_pid = a.engine_pid()
        os.kill(old_pid, signal.SIGKILL)
        # Gone from the registry long before its 120 s TTL: the agent deregistered it.
        await until(lambda: _absent(a), 5, "deregistration after the engine died")
        await until(lambda: a.epoch_at_least(first.epoch + 1), 30, "registration under a new epoch")
        second = await a.registered()
        assert second is not None and second.node_id == first.node_id and second.epoch > first.epoch
        assert a.engine_pid() != old_pid
        [status] = [s for s in await a.registry.statuses() if s.node_id == a.settings.node_id]
        assert status.state is NodeState.SERVING and status.restarts == 1 and status.epoch == second.epoch
        assert status.last_exit == "engine killed by SIGKILL"


async def _absent(a: Agent) -> bool:
    return await a.registered() is None


async def test_a_leftover_helper_is_stopped_before_the_restart_so_its_port_is_free(redis_unit_url: str) -> None:
    """Only the leader dies (as when vLLM's API server is killed): its helper, which holds port+2, must
    be gone before the next start, or the port check would refuse it."""
    async with agent(redis_unit_url, lambda n: ["--helper"]) as a:
        await until(lambda: a.epoch_at_least(1), 30, "first registration")
        await until(_async(lambda: not port_free("127.0.0.1", a.settings.port + 2)), 10, "the helper's port")
        os.kill(a.engine_pid(), signal.SIGKILL)
        await until(lambda: a.epoch_at_least(2), 30, "restart after the leader died")
        assert a.sup.restarts == 1 and a.sup.last_exit == "engine killed by SIGKILL"  # one failure, no port error


def _async(pred: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return pred()

    return check


async def test_a_stopped_engine_counts_as_hung_and_is_killed_and_restarted(redis_unit_url: str) -> None:
    async with agent(redis_unit_url) as a:
        await until(lambda: a.epoch_at_least(1), 30, "first registration")
        pid = a.engine_pid()
        os.kill(pid, signal.SIGSTOP)
        await until(lambda: a.epoch_at_least(2), 30, "restart of the stopped engine")
        assert a.sup.last_exit is not None and a.sup.last_exit.startswith("hung:"), a.sup.last_exit
        assert not _alive(pid), "the hung engine was left behind"


async def test_failed_probes_short_of_hung_keep_the_node_registered(
    redis_unit_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A busy engine that misses a few probes is not dead: the agent keeps its entry alive (with the last
    load) until it counts as hung, so the node stays in routing although each failed probe outlasts a
    heartbeat and the TTL here is a little over one probe round."""
    caplog.set_level(logging.WARNING, logger="tandem.node")
    async with agent(
        redis_unit_url, registry_ttl_s=1.5, health_failures=50, stall_timeout_s=60.0, stall_compute_timeout_s=60.0
    ) as a:
        await until(lambda: a.epoch_at_least(1), 30, "first registration")
        pid = a.engine_pid()
        os.kill(pid, signal.SIGSTOP)  # every probe now times out (0.5 s each, /health and /metrics)
        try:

            async def still_registered_after_failed_probes() -> bool:
                [node] = [n for n in await a.registry.live_nodes() if n.info.node_id == a.settings.node_id] or [None]
                assert node is not None, "the node left the registry on probes short of hung"
                failed = sum("probe" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
                return failed >= 6 and node.load.failed_probes > 0  # marked, so routers route around it

            await until(still_registered_after_failed_probes, 30, "six failed probes")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert a.sup.restarts == 0 and (await a.registered()) is not None

        async def answered_again() -> bool:
            return any(
                n.info.node_id == a.settings.node_id and n.load.failed_probes == 0
                for n in await a.registry.live_nodes()
            )

        await until(answered_again, 30, "the mark cleared by the next probe that answers")


async def test_an_engine_with_requests_but_no_progress_counts_as_hung(redis_unit_url: str) -> None:
    async with agent(redis_unit_url, lambda n: ["--busy"] if n == 1 else []) as a:
        await until(lambda: a.epoch_at_least(2), 30, "restart of the stalled engine")
        assert a.sup.last_exit is not None and "no token for" in a.sup.last_exit, a.sup.last_exit
        assert "(idle CPU)" in a.sup.last_exit


async def test_an_engine_that_computes_without_a_token_gets_the_longer_limit(redis_unit_url: str) -> None:
    # A long prefill step on a slow CPU: busy, a core in use, no counter moving. Not hung after
    # stall_timeout_s (1 s here), only after stall_compute_timeout_s.
    async with agent(
        redis_unit_url, lambda n: ["--busy", "--burn"] if n == 1 else [], stall_compute_timeout_s=6.0
    ) as a:
        await until(lambda: a.epoch_at_least(1), 30, "first start")
        await until(lambda: a.epoch_at_least(2), 60, "restart after the compute limit")
        # The supervisor's own count of the still seconds, not the test's: on a loaded host the test
        # sees the first start late (CI: 3.4 s between the two observations of a 6 s limit).
        assert a.sup.last_exit is not None and "(computing)" in a.sup.last_exit, a.sup.last_exit
        assert _still_s(a.sup.last_exit) >= 6, a.sup.last_exit  # the 1 s idle-CPU limit did not apply


async def test_an_engine_waiting_for_a_kv_pull_gets_the_longer_limit(redis_unit_url: str) -> None:
    # A decode node whose layer-wise pull waits for a long prefill on another node: a request waiting,
    # no CPU used, no counter moving, a pull under way. Found by bench kv-transfer on a 2-core AVX2 host
    # (1k-token bf16 prefills of ~30 s): the 30 s idle limit restarted a healthy decode engine.
    async with agent(redis_unit_url, lambda n: ["--pulling"] if n == 1 else [], stall_compute_timeout_s=6.0) as a:
        await until(lambda: a.epoch_at_least(1), 30, "first start")
        await until(lambda: a.epoch_at_least(2), 60, "restart after the longer limit")
        assert a.sup.last_exit is not None and "(pulling KV)" in a.sup.last_exit, a.sup.last_exit
        assert _still_s(a.sup.last_exit) >= 6, a.sup.last_exit  # the 1 s idle-CPU limit did not apply


def _still_s(last_exit: str) -> int:
    """The seconds without a token a hang's reason names ("... and no token for 7 s (computing)")."""
    found = re.search(r"no token for (\d+) s", last_exit)
    assert found is not None, last_exit
    return int(found.group(1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_an_engine_that_keeps_failing_makes_the_node_unhealthy_instead_of_looping(redis_unit_url: str) -> None:
    async with agent(redis_unit_url, lambda n: ["--exit-status", "7"], max_failures=3) as a:
        code = await asyncio.wait_for(a.task, 30)
        assert code == EXIT_UNHEALTHY and a.sup.restarts == 2
        assert await a.registered() is None
        [status] = [s for s in await a.registry.statuses() if s.node_id == a.settings.node_id]
        assert status.state is NodeState.UNHEALTHY
        assert status.last_exit == "engine exit status 7 during start-up"


async def test_a_taken_port_fails_the_first_start_at_once_naming_the_holder(redis_unit_url: str) -> None:
    settings = fast_settings(redis_unit_url)
    holder = socket.socket()
    holder.bind(("127.0.0.1", settings.port))
    holder.listen()
    try:
        async with agent(redis_unit_url, port=settings.port) as a:
            with pytest.raises(PortInUse) as err:
                await asyncio.wait_for(a.task, 5)
        msg = err.value.message
        assert f"port {settings.port} (engine HTTP)" in msg and f"pid {os.getpid()}" in msg, msg
    finally:
        holder.close()


async def test_an_unreachable_registry_does_not_stop_the_node_serving() -> None:
    """Redis down (or restarting) while the engine starts: the node serves and keeps trying to beat."""
    closed = free_port_block()
    async with agent(f"redis://127.0.0.1:{closed}/0") as a:
        await until(_async(lambda: a.sup.state is NodeState.SERVING), 30, "serving without a registry")
        assert a.sup.epoch == 1 and not a.task.done()
