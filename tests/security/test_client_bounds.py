"""Every size a client picks is bounded at the edge (issue 35, item 4), against a real router (uvicorn,
real Redis) over a stand-in engine: a 1 MB ``model`` is a 400 that echoes nothing back and leaves
Redis as it was; 100 kB of headers is a 431; a body trickled past the read deadline is a 408 and the
tenant's stream slot comes back. The router keeps serving after each."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from tests.security.support import REDIS_URL, Router, router

CHAT = "/v1/chat/completions"
MB = 1024 * 1024


async def _prefix_bytes(prefix: str) -> int:
    """Bytes Redis holds under the router's own key prefix."""
    r = aioredis.Redis.from_url(REDIS_URL)
    try:
        total = 0
        async for key in r.scan_iter(match=f"{prefix}*", count=1000):
            total += int(await r.memory_usage(key) or 0)
        return total
    finally:
        await r.aclose()


async def _served(client: httpx.AsyncClient, r: Router) -> None:
    ok = await client.post(CHAT, json=r.chat())
    assert ok.status_code == 200, ok.text


async def test_a_1_mb_model_name_is_400_and_costs_redis_nothing(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        await _served(client, r)
        before = await _prefix_bytes(r.admission.key_prefix or "")
        for path, body in (
            (CHAT, {**r.chat(), "model": "m" * MB}),
            ("/v1/completions", {"model": "m" * MB, "prompt": "hi", "max_tokens": 4}),
            (CHAT, {**r.chat(), "user": "u" * MB}),
        ):
            answer = await client.post(path, json=body)
            assert answer.status_code == 400, answer.text[:300]
            assert answer.json()["error"]["code"] == "string_too_long"
            assert len(answer.content) < 2048  # the name is not echoed back
        assert await _prefix_bytes(r.admission.key_prefix or "") - before < 16 * 1024
        await _served(client, r)


async def test_100_kb_of_headers_is_431(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        for headers in ({"x-session-id": "s" * 100_000}, {f"x-h{i}": "v" * 1000 for i in range(100)}):
            answer = await client.post(CHAT, json=r.chat(), headers=headers)
            assert answer.status_code == 431, answer.text[:300]
            assert answer.json()["error"]["code"] == "request_header_fields_too_large"
        await _served(client, r)


def _trickle(url: str, chunk_every_s: float, within_s: float) -> tuple[int, float]:
    """POST a 100-byte body one byte every ``chunk_every_s``; returns the answer's status and the
    seconds from the request's start to the answer."""
    host, port = url.removeprefix("http://").split(":")
    body = b'{"model":"x","messages":[]}'.ljust(100)
    with socket.create_connection((host, int(port)), timeout=within_s) as sock:
        t0 = time.monotonic()
        sock.sendall(
            b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % (CHAT.encode(), len(body))
        )
        sock.setblocking(False)
        answer = b""
        for byte in body:
            try:
                answer += sock.recv(65536)
            except BlockingIOError:
                pass
            if answer:
                break
            sock.sendall(bytes([byte]))
            time.sleep(chunk_every_s)  # the attack itself: a client that sends a byte at a time
        sock.setblocking(True)
        while b"\r\n" not in answer:
            answer += sock.recv(65536)
        return int(answer.split(b" ", 2)[1]), time.monotonic() - t0


async def test_a_trickled_body_is_408_at_the_deadline_and_frees_its_slot(tmp_path: Path) -> None:
    async with (
        router(tmp_path, body_read_timeout_s=1.0, admission_overrides={"tenant_max_streams": 1}) as r,
        httpx.AsyncClient(base_url=r.url, timeout=30) as client,
    ):
        await _served(client, r)
        status, took = await asyncio.to_thread(_trickle, r.url, 0.05, 20.0)
        assert status == 408
        assert 1.0 <= took < 4.0
        # the one stream slot of the tenant is back: the next request is served, not a 429
        end = time.monotonic() + 10
        while r.app.services.admission.streams.inflight("anonymous"):
            assert time.monotonic() < end, "the slot was not freed"
            await asyncio.sleep(0.02)
        await _served(client, r)
