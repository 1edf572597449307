"""Engines answer only the node agent and the router (issue 13): a node starts its engine with an API
key derived from the cluster secret, in the environment (``VLLM_API_KEY``), never on the command line;
the router sends it on every engine call, the agent on its own. The engine side is vLLM's own
authentication middleware (the code ``vllm serve`` runs for ``--api-key``/``VLLM_API_KEY``) in front of
the stand-in engine; the real-engine check is ``tests/e2e/test_engine_auth.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from contracts import secret as auth
from contracts.errors import ConfigError
from contracts.registry import Role
from contracts.secret import SECRET_ENV, cluster_engine_api_key, engine_api_key
from node_agent.node import describe, engine_command, engine_env
from node_agent.settings import NodeSettings
from tests.security.support import router

CHAT = "/v1/chat/completions"


def test_the_node_passes_the_key_by_environment_only(monkeypatch: pytest.MonkeyPatch) -> None:
    key = cluster_engine_api_key(loopback_only=True)
    assert key == engine_api_key(auth.load_cluster_secret(loopback_only=True)) and len(key) == 64
    s = NodeSettings(role=Role.PREFILL, port=9100)
    assert engine_env(s)["VLLM_API_KEY"] == key
    cmd = engine_command(s, Path("/models/m"))
    assert key not in " ".join(cmd) and "--api-key" not in cmd
    # An open engine on request (benchmarks' plain vLLM), whatever the environment held.
    monkeypatch.setenv("VLLM_API_KEY", "inherited")
    assert "VLLM_API_KEY" not in engine_env(NodeSettings(role=Role.BOTH, port=9100, engine_auth=False))
    # A node on a real interface needs the cluster's explicit secret to have the cluster's key.
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ConfigError):
        NodeSettings(role=Role.BOTH, host="0.0.0.0", port=9100).engine_headers()


async def test_the_agent_reads_its_engine_with_the_key() -> None:
    s = NodeSettings(role=Role.BOTH, port=9100)
    key = cluster_engine_api_key(loopback_only=True)

    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1") and request.headers.get("authorization") != f"Bearer {key}":
            return httpx.Response(401, json={"error": "Unauthorized"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        return httpx.Response(200, text="")

    # The supervisor's client: headers=settings.engine_headers() (node_agent/supervisor.py).
    async with httpx.AsyncClient(headers=s.engine_headers(), transport=httpx.MockTransport(engine)) as client:
        assert (await describe(s, client, Path("/models/m"))).model == "m"


def _guarded(tokens: list[str]) -> Callable[[Any], Any]:
    """vLLM's middleware before an app (wrapped in a coroutine function: uvicorn takes a plain callable
    for an ASGI2 app)."""

    def wrap(app: Any) -> Any:
        middleware = AuthenticationMiddleware(app, tokens=tokens)

        async def guarded(scope: Any, receive: Any, send: Any) -> None:
            await middleware(scope, receive, send)

        return guarded

    return wrap


async def test_an_engine_port_answers_only_with_the_key(tmp_path: Path) -> None:
    key = cluster_engine_api_key(loopback_only=True)
    async with router(tmp_path, engine_wrapper=_guarded([key])) as r, httpx.AsyncClient(timeout=30) as client:
        assert r.node is not None and r.engine is not None
        for stream in (False, True):
            resp = await client.post(r.url + CHAT, json=r.chat(stream=stream))
            assert resp.status_code == 200, resp.text
        engine = r.node.url
        assert (await client.post(engine + CHAT, json=r.chat())).status_code == 401
        wrong = {"Authorization": "Bearer tdm-a-client-key"}
        assert (await client.post(engine + CHAT, json=r.chat(), headers=wrong)).status_code == 401
        assert (await client.get(engine + "/health")).status_code == 200  # vLLM guards /v1/* only
        assert len(r.engine.bodies()) == 2


async def test_a_router_with_another_secret_is_a_502_not_the_clients_401(tmp_path: Path) -> None:
    async with router(tmp_path, engine_wrapper=_guarded(["another-clusters-key"])) as r, httpx.AsyncClient() as client:
        for stream in (False, True):
            resp = await client.post(r.url + CHAT, json=r.chat(stream=stream), timeout=30)
            assert resp.status_code == 502, resp.text
            assert "cluster secret" in resp.json()["error"]["message"]


def test_the_key_follows_the_secret_the_environment_names_now(monkeypatch: pytest.MonkeyPatch) -> None:
    # One test process may start clusters under different secrets: a key remembered from the first
    # would be refused (401) by every engine of the next.
    monkeypatch.setenv(SECRET_ENV, "a" * 40)
    first = cluster_engine_api_key(loopback_only=True)
    monkeypatch.setenv(SECRET_ENV, "b" * 40)
    assert cluster_engine_api_key(loopback_only=True) == engine_api_key(b"b" * 40) != first
