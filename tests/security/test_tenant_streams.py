"""A tenant may hold only so many requests in flight at once (issue 13): one more is a 429, other
tenants are not affected, and the slot comes back however a request ends (answered, refused after
admission, client gone). Real router, stand-in engine whose gate holds answers until opened."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from contracts.errors import RateLimited
from router.admission.concurrency import TenantStreams
from tests.security.support import Router, router

CHAT = "/v1/chat/completions"


def test_counts_per_tenant_and_releases_once() -> None:
    streams = TenantStreams(1, {"big": 2, "free": 0})
    release = streams.acquire("acme")
    with pytest.raises(RateLimited) as refused:
        streams.acquire("acme")
    assert refused.value.status_code == 429 and refused.value.code == "rate_limit_exceeded"
    assert "1 in flight" in refused.value.message
    release()
    release()  # idempotent: a second call must not free another request's slot
    assert streams.inflight("acme") == 0
    held = [streams.acquire("big"), streams.acquire("big")]
    with pytest.raises(RateLimited):
        streams.acquire("big")
    for _ in range(10):
        held.append(streams.acquire("free"))  # 0: unlimited
    for r in held:
        r()
    assert streams.inflight("big") == streams.inflight("free") == 0


async def _until(check, timeout_s: float = 20) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)  # the stand-in and the router run in threads: nothing to await on


def _inflight(r: Router, tenant: str) -> int:
    return int(r.app.services.admission.streams.inflight(tenant))


async def test_over_the_limit_is_429_and_every_exit_frees_the_slot(tmp_path: Path) -> None:
    async with (
        router(tmp_path, admission_overrides={"tenant_max_streams": 2}) as r,
        httpx.AsyncClient(base_url=r.url, timeout=30) as client,
    ):
        assert r.engine is not None
        acme, globex = await r.create_key("acme"), await r.create_key("globex")
        r.engine.close_gate()
        held = [
            asyncio.create_task(client.post(CHAT, json=r.chat(stream=stream), headers=acme)) for stream in (True, False)
        ]
        await _until(lambda: r.engine is not None and r.engine.in_flight == 2)
        resp = await client.post(CHAT, json=r.chat(), headers=acme)
        assert resp.status_code == 429, resp.text
        error = resp.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "2 in flight" in error["message"]
        assert resp.headers["Retry-After"] == "1"
        other = asyncio.create_task(client.post(CHAT, json=r.chat(), headers=globex))  # another tenant: served
        await _until(lambda: r.engine is not None and r.engine.in_flight == 3)
        r.engine.open_gate()
        for task in (*held, other):
            assert (await task).status_code == 200
        assert _inflight(r, "acme") == _inflight(r, "globex") == 0

        # Refused after admission (the context check runs after the slot is taken): freed every time.
        for _ in range(3):
            resp = await client.post(CHAT, json=r.chat(max_tokens=100_000), headers=acme)
            assert resp.status_code == 400, resp.text
        assert _inflight(r, "acme") == 0

        # A client that goes away while its request waits on the engine: freed too.
        r.engine.close_gate()
        for stream in (True, False):
            gone = asyncio.create_task(client.post(CHAT, json=r.chat(stream=stream), headers=acme))
            await _until(lambda: _inflight(r, "acme") == 1)
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            await _until(lambda: _inflight(r, "acme") == 0)
        r.engine.open_gate()
        for _ in range(2):
            assert (await client.post(CHAT, json=r.chat(), headers=acme)).status_code == 200


async def test_per_tenant_overrides(tmp_path: Path) -> None:
    limits = {"tenant_max_streams": 1, "tenant_max_streams_overrides": {"big": 2}}
    async with (
        router(tmp_path, admission_overrides=limits) as r,
        httpx.AsyncClient(base_url=r.url, timeout=30) as client,
    ):
        assert r.engine is not None
        big = await r.create_key("big")
        r.engine.close_gate()
        held = [asyncio.create_task(client.post(CHAT, json=r.chat(), headers=big)) for _ in range(2)]
        await _until(lambda: r.engine is not None and r.engine.in_flight == 2)
        assert (await client.post(CHAT, json=r.chat(), headers=big)).status_code == 429
        r.engine.open_gate()
        for task in held:
            assert (await task).status_code == 200
