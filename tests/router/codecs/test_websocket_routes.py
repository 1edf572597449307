"""The Responses and Chat Completions WebSockets on the real router (uvicorn with its WebSocket server,
the exchange, the relay) over stand-in engines: the official ``openai`` SDK's WebSocket mode and the
``websockets`` library talk to it; chains resolve on the socket, with ``store: false`` too; one response
at a time; cancelling frees the engine's stream; refusals come in the API's shape; the lake row and
``/metrics`` say the request came by WebSocket."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
import websockets

from contracts.registry import Role
from tests.router.admission.support import wait_until
from tests.support.standin_cluster import metric, standin_cluster


def _ws_url(url: str, path: str) -> str:
    return url.replace("http://", "ws://") + path


async def _events_until_end(ws: Any) -> list[dict[str, Any]]:
    """Server events of one response, through its terminal event (or an error event)."""
    out: list[dict[str, Any]] = []
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), 30))
        out.append(ev)
        if ev["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return out


async def test_sdk_websocket_mode_chains_on_the_socket(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 4}) as c:
        sdk = openai.AsyncOpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)
        async with sdk.responses.connect() as conn:
            await conn.response.create(model=c.model, input="hello", max_output_tokens=8, store=False)
            kinds, text, first = [], [], None
            async for ev in conn:
                kinds.append(ev.type)
                if ev.type == "response.output_text.delta":
                    text.append(ev.delta)
                if ev.type in ("response.completed", "response.incomplete"):
                    first = ev.response
                    break
            assert kinds[:2] == ["response.created", "response.in_progress"] and first is not None and text
            assert first.output_text == "".join(text)
            # store: false, yet the socket chains on its last response (OpenAI's WebSocket mode).
            await conn.response.create(model=c.model, input="again", previous_response_id=first.id, store=False)
            async for ev in conn:
                if ev.type in ("response.completed", "response.incomplete"):
                    assert ev.response.previous_response_id == first.id
                    break
        body = c.engines["n"].received[-1][1]
        contents = [m["content"] for m in body["messages"]]
        assert "hello" in contents and "again" in contents and "".join(text) in contents
        # Nothing was stored: another socket (or HTTP) cannot chain on it.
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.create(model=c.model, input="x", previous_response_id=first.id)


async def test_one_response_at_a_time_and_cancel(tmp_path) -> None:
    engine = {"stream_tokens": 200, "token_interval_s": 0.05}
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine=engine) as c:
        async with websockets.connect(_ws_url(c.url, "/v1/responses")) as ws:
            create = {"type": "response.create", "model": c.model, "input": "long", "max_output_tokens": 200}
            await ws.send(json.dumps(create))
            first = json.loads(await ws.recv())
            assert first["type"] == "response.created"
            await ws.send(json.dumps(create))
            while (ev := json.loads(await ws.recv()))["type"] != "error":
                assert ev["type"].startswith("response.")
            assert ev["error"]["code"] == "response_in_progress"
            engine_side = c.engines["n"]
            assert engine_side.streams_open == 1
            await ws.send(json.dumps({"type": "response.cancel"}))
            while (ev := json.loads(await ws.recv()))["type"] != "error":
                pass
            assert ev["error"]["code"] == "response_cancelled"
            await wait_until(lambda: engine_side.streams_open == 0)
            # The socket is still usable.
            await ws.send(json.dumps({**create, "max_output_tokens": 3}))
            events = await _events_until_end(ws)
            assert events[-1]["type"] in ("response.completed", "response.incomplete")
            # Bad messages are error events, not a closed socket.
            await ws.send("not json")
            assert json.loads(await ws.recv())["error"]["code"] == "invalid_json"
            await ws.send(json.dumps({"type": "session.update"}))
            assert json.loads(await ws.recv())["error"]["code"] == "unknown_event"
        await wait_until(lambda: engine_side.streams_open == 0)


async def test_refusals_at_the_upgrade_and_per_response(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 4}) as c:
        key = await c.create_key("acme")
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(_ws_url(c.url, "/v1/responses")):
                pass
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body)["error"]["code"] == "missing_api_key"
        headers = {"Authorization": f"Bearer {key}"}
        async with websockets.connect(_ws_url(c.url, "/v1/responses"), additional_headers=headers) as ws:
            await ws.send(json.dumps({"type": "response.create", "model": "nope", "input": "x"}))
            ev = json.loads(await ws.recv())
            assert ev["type"] == "error" and ev["status"] == 404 and ev["error"]["param"] == "model"
        # The key as a subprotocol, as browsers must send it.
        sub = [f"openai-insecure-api-key.{key}", "openai-beta.responses-v1"]
        async with websockets.connect(_ws_url(c.url, "/v1/responses"), subprotocols=sub) as ws:  # type: ignore[arg-type]
            assert ws.subprotocol == "openai-beta.responses-v1"
            await ws.send(json.dumps({"type": "response.create", "model": c.model, "input": "hi"}))
            assert (await _events_until_end(ws))[-1]["type"] in ("response.completed", "response.incomplete")


async def test_chat_over_a_socket_and_transport_recorded(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 4}) as c:
        async with websockets.connect(_ws_url(c.url, "/v1/chat/completions")) as ws:
            for turn in range(2):
                await ws.send(json.dumps(c.chat(f"turn {turn}")))
                chunks = []
                while (msg := await ws.recv()) != "[DONE]":
                    chunks.append(json.loads(msg))
                assert chunks and all(ch["object"] == "chat.completion.chunk" for ch in chunks)
            await ws.send(json.dumps(c.chat("x", model="nope")))
            assert json.loads(await ws.recv())["error"]["param"] == "model"
        async with httpx.AsyncClient(base_url=c.url) as client:
            text = (await client.get("/metrics")).text
        assert metric(text, "tandem_requests_by_transport_total", endpoint="chat", transport="websocket") == 3.0
        assert metric(text, "tandem_ws_upgrades_total", api="chat", outcome="accepted") == 1.0
        assert metric(text, "tandem_ws_open", api="chat") == 0.0
