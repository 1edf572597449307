"""The guard the node agent loads into its engine (``node_agent.engine_guard``): a real Starlette app
behind it, every path refused without the engine key but the open ones, and the engine command that
loads it whenever the engine has a key."""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from contracts.registry import Role
from node_agent.engine_guard import OPEN_PATHS, EngineGuard
from node_agent.node import engine_command
from node_agent.settings import NodeSettings

KEY = "engine-key-for-the-test"


async def _ok(request):  # type: ignore[no-untyped-def]
    return PlainTextResponse("served")


async def _ws(ws: WebSocket) -> None:
    await ws.accept()
    await ws.send_text("served")
    await ws.close()


def _client(key: str | None = KEY) -> TestClient:
    paths = ["/health", "/ping", "/metrics", "/invocations", "/tokenize", "/v1/chat/completions", "/version"]
    routes = [Route(p, _ok, methods=["GET", "POST"]) for p in paths] + [WebSocketRoute("/v1/realtime", _ws)]
    app = Starlette(routes=routes)
    app.add_middleware(EngineGuard, key=key)
    return TestClient(app)


def test_every_path_but_the_open_ones_needs_the_key() -> None:
    client = _client()
    for path in ("/invocations", "/tokenize", "/v1/chat/completions", "/version", "/nowhere"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
            resp = client.post(path, json={}, headers=headers)
            assert resp.status_code == 401, (path, headers)
            assert resp.json()["error"]["code"] == "invalid_api_key"
        assert client.post(path, json={}, headers={"Authorization": f"Bearer {KEY}"}).status_code in (200, 404)
    for path in OPEN_PATHS:
        assert client.get(path).text == "served"
    # Not a prefix: a path that merely starts like an open one is guarded.
    assert client.get("/health/../invocations").status_code in (401, 404)
    assert client.get("/metricsx").status_code == 401


def test_a_websocket_without_the_key_is_closed_before_it_is_accepted() -> None:
    client = _client()
    try:
        with client.websocket_connect("/v1/realtime") as ws:
            ws.receive_text()
        raise AssertionError("the guard let a keyless WebSocket through")
    except WebSocketDisconnect as refused:
        assert refused.code == 1008
    with client.websocket_connect("/v1/realtime", headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert ws.receive_text() == "served"


def test_without_a_key_the_guard_lets_everything_through() -> None:
    assert _client(key="").post("/invocations", json={}).text == "served"


def test_the_engine_command_loads_the_guard_whenever_the_engine_has_a_key() -> None:
    guarded = engine_command(NodeSettings(role=Role.BOTH, port=9100, engine_auth=True), Path("/models/m"))
    assert guarded[guarded.index("--middleware") + 1] == "node_agent.engine_guard.EngineGuard"
    open_ = engine_command(NodeSettings(role=Role.BOTH, port=9100, engine_auth=False), Path("/models/m"))
    assert "--middleware" not in open_
