"""The Responses and Chat Completions WebSockets on the real router (uvicorn with its WebSocket server,
the exchange, the relay) over stand-in engines: the official ``openai`` SDK's WebSocket mode and the
``websockets`` library talk to it; chains resolve on the socket, with ``store: false`` too; one response
at a time; cancelling frees the engine's stream; refusals come in the API's shape; the lake row and
``/metrics`` say the request came by WebSocket."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import time
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
    engine: dict[str, object] = {"stream_tokens": 200, "token_interval_s": 0.05}
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


async def test_a_prewarm_completes_at_once_and_the_next_turn_chains_on_it(tmp_path) -> None:
    """Codex opens each socket with a ``generate: false`` create, drops the socket if it does not complete
    in time, and chains its first turn on it (``previous_response_id``, with only the new input): the
    prewarm is answered with an empty completed response and no engine work, and the turn gets the
    prewarm's input as history."""
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 4}) as c:
        engine_side = c.engines["n"]
        async with websockets.connect(_ws_url(c.url, "/v1/responses")) as ws:
            prewarm = {
                "type": "response.create",
                "model": c.model,
                "instructions": "be brief",
                "input": [{"role": "user", "content": "the repository is tandem"}],
                "store": False,
                "generate": False,
            }
            await ws.send(json.dumps(prewarm))
            events = await _events_until_end(ws)
            assert [e["type"] for e in events] == ["response.created", "response.completed"]
            done = events[-1]["response"]
            assert done["status"] == "completed" and done["output"] == [] and done["model"] == c.model
            assert done["id"].startswith("resp_") and events[0]["response"]["id"] == done["id"]
            assert engine_side.received == []
            turn = {
                "type": "response.create",
                "model": c.model,
                "instructions": "be brief",
                "input": [{"role": "user", "content": "say hi"}],
                "previous_response_id": done["id"],
                "store": False,
                "max_output_tokens": 3,
            }
            await ws.send(json.dumps(turn))
            events = await _events_until_end(ws)
            assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
            assert len(engine_side.received) == 1
            sent = [m["content"] for m in engine_side.received[0][1]["messages"] if m["role"] == "user"]
            assert sent == ["the repository is tandem", "say hi"]
            # A prewarm that names an unknown response is refused on the socket, which stays open.
            await ws.send(json.dumps({**prewarm, "previous_response_id": "resp_nope"}))
            ev = json.loads(await ws.recv())
            assert ev["type"] == "error" and ev["status"] == 404, ev


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


async def test_idle_socket_closed_and_tenant_cap(tmp_path) -> None:
    router: dict[str, object] = {"ws_idle_timeout_s": 0.5, "ws_max_per_tenant": 1}
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 4}, router=router) as c:
        async with websockets.connect(_ws_url(c.url, "/v1/responses")) as ws:
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with websockets.connect(_ws_url(c.url, "/v1/chat/completions")):
                    pass
            assert refused.value.response.status_code == 429
            assert json.loads(refused.value.response.body)["error"]["type"] == "rate_limit_error"
            with pytest.raises(websockets.ConnectionClosedOK):
                await asyncio.wait_for(ws.recv(), 30)  # nothing in flight, nothing sent: closed when idle
            assert ws.close_code == 1000 and ws.close_reason == "idle timeout"
        # Its slot was given back: a new socket opens.
        async with websockets.connect(_ws_url(c.url, "/v1/responses")) as ws:
            await ws.send(json.dumps({"type": "response.create", "model": c.model, "input": "hi"}))
            assert (await _events_until_end(ws))[-1]["type"] in ("response.completed", "response.incomplete")


async def test_age_limit_between_responses(tmp_path) -> None:
    engine: dict[str, object] = {"stream_tokens": 10, "token_interval_s": 0.1}
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine=engine, router={"ws_max_age_s": 0.5}) as c:
        async with websockets.connect(_ws_url(c.url, "/v1/responses")) as ws:
            await ws.send(json.dumps({"type": "response.create", "model": c.model, "input": "hi"}))
            # The response in flight when the age passes is answered whole; then the socket ends.
            assert (await _events_until_end(ws))[-1]["type"] in ("response.completed", "response.incomplete")
            ev = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert ev["error"]["code"] == "websocket_connection_limit_reached"
            with pytest.raises(websockets.ConnectionClosedOK):
                await asyncio.wait_for(ws.recv(), 30)


async def _raw_socket(url: str, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket client that reads nothing unless told to (the ``websockets`` client keeps reading
    into its own buffers whatever its queue size, so it cannot stall a server)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    status = await reader.readuntil(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 101"), status
    return reader, writer


def _client_text_frame(payload: bytes) -> bytes:
    """One masked text frame, as a client must send it (RFC 6455 5.2)."""
    mask = os.urandom(4)
    n = len(payload)
    length = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    return b"\x81" + length + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def test_a_client_that_stops_reading_is_cut(tmp_path) -> None:
    # Paced so the whole answer would take over 25 s: the engine's stream ending sooner is the cut.
    engine: dict[str, object] = {"stream_tokens": 200_000, "burst": 16, "token_interval_s": 0.002}
    router: dict[str, object] = {"client_send_timeout_s": 1.0}
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine=engine, router=router, max_model_len=300_000) as c:
        reader, writer = await _raw_socket(c.url, "/v1/responses")
        create = {"type": "response.create", "model": c.model, "input": "x", "max_output_tokens": 200_000}
        writer.write(_client_text_frame(json.dumps(create).encode()))
        engine_side = c.engines["n"]
        started = time.monotonic()
        await wait_until(lambda: engine_side.streams_open == 1)
        await wait_until(lambda: engine_side.streams_open == 0)  # cut: the engine's work freed
        assert time.monotonic() - started < 20
        # The router dropped the connection with what it had not sent: the client's read ends (EOF or a
        # reset) after the little its own small buffer holds.
        with contextlib.suppress(ConnectionResetError):
            while await asyncio.wait_for(reader.read(1 << 16), 30):
                pass
        writer.close()
        async with httpx.AsyncClient(base_url=c.url) as client:
            assert metric((await client.get("/metrics")).text, "tandem_ws_open", api="responses") == 0.0
        # The replica serves on.
        async with websockets.connect(_ws_url(c.url, "/v1/responses")) as ws:
            await ws.send(json.dumps({**create, "max_output_tokens": 3}))
            assert (await _events_until_end(ws))[-1]["type"] in ("response.completed", "response.incomplete")


async def test_a_stopping_router_closes_with_a_code_clients_retry_on(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 4}) as c:
        async with websockets.connect(_ws_url(c.url, "/v1/responses")) as ws:
            assert c.router_server is not None
            c.router_server.server.should_exit = True
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            # 1012 (service restart) is one the OpenAI SDK reconnects on.
            assert ws.close_code == 1012
            from openai.types.websocket_reconnection import is_recoverable_close

            assert is_recoverable_close(ws.close_code)


async def test_a_chain_crosses_sockets_through_the_store(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 4}) as c:
        url = _ws_url(c.url, "/v1/responses")
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "response.create", "model": c.model, "input": "first socket"}))
            first = (await _events_until_end(ws))[-1]["response"]
        stored = await _stored_over_http(c.url, first["id"])
        assert stored["status"] == first["status"]
        async with websockets.connect(url) as ws:
            chained = {"type": "response.create", "model": c.model, "input": "second socket"}
            await ws.send(json.dumps({**chained, "previous_response_id": first["id"]}))
            assert (await _events_until_end(ws))[-1]["response"]["previous_response_id"] == first["id"]
        contents = [m["content"] for m in c.engines["n"].received[-1][1]["messages"]]
        assert "first socket" in contents and "second socket" in contents


async def _stored_over_http(url: str, response_id: str) -> dict[str, Any]:
    """The stored Response, once its (background) save landed."""
    async with httpx.AsyncClient(base_url=url) as client:
        found: dict[str, Any] = {}

        async def stored() -> bool:
            resp = await client.get(f"/v1/responses/{response_id}")
            found.update(resp.json() if resp.status_code == 200 else {})
            return resp.status_code == 200

        await wait_until(stored)
        return found
