"""A real router (its ASGI app under uvicorn on loopback, real Redis registry and admission, SQLite
store) in front of STAND-IN engines (``bench.standin_engine``: fixed replies, no model), for router
tests that must hold node slots or see exactly what reached a node. Redis DB 7; each use has its own
model name and key prefix, and removes its nodes and keys afterwards."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from bench.standin_engine import ServerThread, StandInEngine, free_port
from contracts.registry import NodeInfo, NodeRegistry, Role
from router.admission.context import AdmissionContext, AdmissionSettings
from router.admission.priority_class import Priority
from router.edge.app import create_app
from router.settings import RouterSettings
from tests.router.admission.support import delete_prefix

REDIS_URL = "redis://127.0.0.1:6379/7"


@dataclass
class StandInCluster:
    url: str
    """The router's base URL."""
    model: str
    engines: dict[str, StandInEngine]
    """Stand-in engine per node name (as given to ``standin_cluster``)."""
    node_ids: dict[str, str]
    """Registry node id per node name."""
    admission: AdmissionSettings
    router_server: ServerThread | None = None
    """The router's uvicorn (a test may stop it: ``router_server.server.should_exit = True``)."""
    admin_headers: dict[str, str] = field(default_factory=dict)
    """``Authorization`` of an admin key (for /metrics and /cluster), once ``create_key`` turned auth on."""

    async def create_key(self, tenant: str, priority: Priority = Priority.INTERACTIVE, *, admin: bool = False) -> str:
        """A real API key (auth turns on for the router's prefix; an admin key is made with the first)."""
        ctx = await AdmissionContext.create(self.admission, start_writer=False)
        try:
            if not self.admin_headers:
                ops = (await ctx.keys.create_key("ops", rpm=0, tpm=0, admin=True))[1]
                self.admin_headers = {"Authorization": f"Bearer {ops}"}
            return (await ctx.keys.create_key(tenant, rpm=0, tpm=0, priority=priority, admin=admin))[1]
        finally:
            await ctx.close()

    def chat(self, content: str, **kw: object) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


async def register_nodes(nodes: list[NodeInfo]) -> None:
    """Register ``nodes`` in the stand-in clusters' registry (``REDIS_URL``) with a 10-minute TTL."""
    r = aioredis.Redis.from_url(REDIS_URL)
    try:
        reg = NodeRegistry(r, ttl_s=600)
        for n in nodes:
            await reg.register(n)
    finally:
        await r.aclose()


async def deregister_nodes(node_ids: list[str]) -> None:
    r = aioredis.Redis.from_url(REDIS_URL)
    try:
        reg = NodeRegistry(r)
        for node_id in node_ids:
            await reg.deregister(node_id)
    finally:
        await r.aclose()


@asynccontextmanager
async def standin_cluster(
    tmp_path: Path,
    roles: dict[str, Role],
    *,
    dead: dict[str, Role] | None = None,
    policy: str = "cache_aware",
    engine: dict[str, object] | None = None,
    router: dict[str, object] | None = None,
    max_model_len: int = 4096,
    models: dict[str, str] | None = None,
    kv_connector: str = "nixl",
    model_path: str | None = None,
    **admission: object,
) -> AsyncIterator[StandInCluster]:
    """Stand-in engines for ``roles`` (node id → role), registered; a router over them, started.
    ``dead`` nodes are registered at a loopback port nobody listens on (a node whose engine is gone).
    ``admission`` overrides ``AdmissionSettings`` fields (``node_max_concurrency=1``, ...); ``engine``
    ``StandInEngine`` fields (``stream_tokens``, ...) and ``router`` ``RouterSettings`` fields. ``models``
    gives nodes another served model than the cluster's (node name → model name). ``kv_connector="tandem"``
    registers the P/D nodes as ours, each with a block server endpoint nobody listens on (``kv_endpoints``):
    what makes the router send layer-wise pairs. ``model_path``: a model folder the nodes name, so the
    router tokenizes prompts with its tokenizer and template as it does for real engines."""
    tag = uuid.uuid4().hex[:10]
    model, prefix = f"standin-{tag}", f"test-{tag}:"
    node_ids = {name: f"{name}-{tag}" for name in [*roles, *(dead or {})]}
    engines = {name: StandInEngine(**(engine or {})) for name in roles}  # type: ignore[arg-type]
    settings = AdmissionSettings(
        redis_url=REDIS_URL,
        key_prefix=prefix,
        database_url=f"sqlite:///{tmp_path}/t.db",
        region="local",
        region_cache_urls={},
        **admission,
    )  # type: ignore[arg-type]
    async with AsyncExitStack() as stack:
        urls = {name: stack.enter_context(ServerThread(e.app)) for name, e in engines.items()}
        for name in dead or {}:
            urls[name] = f"http://127.0.0.1:{free_port()}"  # bound by nobody: connections are refused
        nodes = [
            NodeInfo(
                node_id=node_ids[name],
                role=role,
                model=(models or {}).get(name, model),
                url=urls[name],
                block_size=16,
                max_model_len=max_model_len,
                kv_connector=kv_connector if role is not Role.BOTH else "none",
                kv_endpoints={"tcp": f"tcp://127.0.0.1:{free_port()}"}
                if kv_connector == "tandem" and role is not Role.BOTH
                else {},
                kv_host_id="standin-host" if kv_connector == "tandem" else "",
                model_path=model_path,
            )
            for name, role in [*roles.items(), *(dead or {}).items()]
        ]
        stack.push_async_callback(delete_prefix, REDIS_URL, prefix)
        stack.push_async_callback(deregister_nodes, list(node_ids.values()))
        await register_nodes(nodes)
        router_settings = RouterSettings(
            redis_url=REDIS_URL,
            registry_refresh_s=60,
            telemetry=False,
            admission=settings,
            policy=policy,
            **(router or {}),  # type: ignore[arg-type]
        )
        server = ServerThread(create_app(router_settings))
        url = stack.enter_context(server)
        yield StandInCluster(
            url=url, model=model, engines=engines, node_ids=node_ids, admission=settings, router_server=server
        )


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from a Prometheus text page (labels matched exactly), None when absent."""
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if got == labels:
            return float(m.group(4))
    return None
