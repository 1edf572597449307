"""A real router for the security tests: its ASGI app under uvicorn, real Redis (DB 14, a key prefix
of its own per use) and a SQLite key store, optionally in front of one STAND-IN engine (the labelled
test double of ``bench.standin_engine``) registered with the real default model's folder, so the
router tokenizes with the real tokenizer and chat template."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench.standin_engine import ServerThread, StandInEngine
from contracts.registry import NodeInfo, NodeRegistry, Role
from node_agent.model import default_model_dir
from router.admission.context import AdmissionContext, AdmissionSettings
from router.edge.app import create_app
from router.settings import RouterSettings
from tests.router.admission.support import delete_prefix

REDIS_URL = "redis://127.0.0.1:6379/14"
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Router:
    url: str
    model: str
    admission: AdmissionSettings
    engine: StandInEngine | None = None
    keys: dict[str, str] = field(default_factory=dict)
    app: Any = None
    """The router's FastAPI app (its ``state`` holds the fleet index, once started)."""
    node: NodeInfo | None = None

    async def create_key(self, tenant: str, *, admin: bool = False) -> dict[str, str]:
        """``Authorization`` headers of a new real key (auth turns on for this router's prefix)."""
        ctx = await AdmissionContext.create(self.admission, start_writer=False)
        try:
            key = (await ctx.keys.create_key(tenant, rpm=0, tpm=0, admin=admin))[1]
        finally:
            await ctx.close()
        return {"Authorization": f"Bearer {key}"}

    def chat(self, content: str = "hi", **kw: object) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


@asynccontextmanager
async def router(
    tmp_path: Path,
    *,
    engine: bool = True,
    max_model_len: int = 4096,
    admission_overrides: dict[str, object] | None = None,
    engine_wrapper: Callable[[Any], Any] | None = None,
    redis_url: str = REDIS_URL,
    **settings: object,
) -> AsyncIterator[Router]:
    """A router (in a uvicorn thread) over at most one stand-in engine; ``settings`` override
    ``RouterSettings`` fields, ``admission_overrides`` ``AdmissionSettings`` fields;
    ``engine_wrapper`` wraps the engine's ASGI app (vLLM's own middleware, say); ``redis_url``: the
    router's Redis (the same database reached another way, say through a proxy)."""
    tag = uuid.uuid4().hex[:10]
    model, prefix = f"sec-{tag}", f"sec-{tag}:"
    adm = AdmissionSettings(
        redis_url=redis_url,
        key_prefix=prefix,
        database_url=f"sqlite:///{tmp_path}/{tag}.db",
        region="local",
        region_cache_urls={},
        **(admission_overrides or {}),
    )  # type: ignore[arg-type]
    async with AsyncExitStack() as stack:
        stack.push_async_callback(delete_prefix, REDIS_URL, prefix)
        eng = node = None
        if engine:
            eng = StandInEngine()
            url = stack.enter_context(ServerThread(engine_wrapper(eng.app) if engine_wrapper else eng.app))
            node = NodeInfo(
                node_id=f"n-{tag}",
                role=Role.BOTH,
                model=model,
                url=url,
                block_size=16,
                max_model_len=max_model_len,
                kv_connector="none",
                model_path=str(default_model_dir()),
            )
            r = aioredis.Redis.from_url(REDIS_URL)
            try:
                await NodeRegistry(r, ttl_s=600).register(node)
            finally:
                await r.aclose()
            stack.push_async_callback(_deregister, node.node_id)
        app = create_app(
            RouterSettings(
                **{"redis_url": redis_url, "registry_refresh_s": 60, "telemetry": False, "admission": adm, **settings}
            )
        )  # type: ignore[arg-type]
        url = stack.enter_context(ServerThread(app))
        yield Router(url=url, model=model, admission=adm, engine=eng, app=app, node=node)


async def _deregister(node_id: str) -> None:
    r = aioredis.Redis.from_url(REDIS_URL)
    try:
        await NodeRegistry(r).deregister(node_id)
    finally:
        await r.aclose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def router_process(tmp_path: Path, **env: str) -> Iterator[tuple[str, int]]:
    """The router as ``tandem`` runs it: its own process (``uvicorn --factory``), settings from the
    environment. Yields (base URL, pid)."""
    port, tag = free_port(), uuid.uuid4().hex[:10]
    full = {
        **os.environ,
        "TANDEM_REDIS_URL": REDIS_URL,
        "TANDEM_KEY_PREFIX": f"sec-{tag}:",
        "TANDEM_SQLITE_PATH": str(tmp_path / f"{tag}.db"),
        "TANDEM_ROUTER_TELEMETRY": "false",
        "TANDEM_ROUTER_REGISTRY_REFRESH_S": "60",
        **env,
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "router.edge.app:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=full,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with {proc.returncode}")
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        import asyncio

        asyncio.run(delete_prefix(REDIS_URL, f"sec-{tag}:"))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@contextmanager
def router_sync(tmp_path: Path, *, admin_key: bool = False, **kw: object) -> Iterator[tuple[Router, dict[str, str]]]:
    """``router`` for synchronous tests (schemathesis drives the API from hypothesis, outside any event
    loop): the router's own set-up and tear-down run on a private loop; the router itself serves from
    its uvicorn thread as usual. With ``admin_key``, a real admin key is created (auth is then on) and
    its ``Authorization`` headers are yielded."""
    import asyncio

    loop = asyncio.new_event_loop()
    cm = router(tmp_path, **kw)  # type: ignore[arg-type]
    try:
        r = loop.run_until_complete(cm.__aenter__())
        try:
            headers = loop.run_until_complete(r.create_key("fuzz", admin=True)) if admin_key else {}
            yield r, headers
        except BaseException as exc:
            if not loop.run_until_complete(cm.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            loop.run_until_complete(cm.__aexit__(None, None, None))
    finally:
        loop.close()
