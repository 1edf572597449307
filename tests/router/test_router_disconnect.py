"""A client that leaves cancels its request everywhere; one that stays is never taken for gone.

The router notices a disconnect with one watcher task per request (``router.edge.disconnect``); these run
the real router (uvicorn, the exchange, the relay) over stand-in engines that stream paced tokens.
"""

from __future__ import annotations

import asyncio

import httpx

from contracts.registry import Role
from tests.router.admission.support import wait_until
from tests.support.standin_cluster import metric, standin_cluster

CHAT = "/v1/chat/completions"


async def _requests(client: httpx.AsyncClient, model: str, status: str) -> float:
    return metric((await client.get("/metrics")).text, "tandem_requests_total", model=model, status=status) or 0.0


async def test_a_client_gone_mid_stream_ends_the_engine_stream_and_frees_its_slot(tmp_path) -> None:
    engine = {"stream_tokens": 2000, "token_interval_s": 0.02}
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine=engine) as c:
        standin = c.engines["n"]
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            async with httpx.AsyncClient(base_url=c.url, timeout=30) as leaving:
                body = c.chat("leave early", stream=True, max_tokens=2000)
                async with leaving.stream("POST", CHAT, json=body) as resp:
                    assert resp.status_code == 200
                    events = 0
                    async for line in resp.aiter_lines():
                        events += line.startswith("data: ")
                        if events == 3:
                            break
                    assert standin.streams_open == 1
            # The connection is closed: the router must abort its upstream stream, long before the
            # stand-in's 2000 tokens (40 s) would have ended it.
            await wait_until(lambda: standin.streams_open == 0)
            await wait_until(lambda: _requests(client, c.model, "cancelled"))
            node = c.node_ids["n"]
            assert metric((await client.get("/metrics")).text, "tandem_admission_slots_in_use", node=node) == 0
            assert await _requests(client, c.model, "ok") == 0


async def test_streams_and_answers_that_complete_are_recorded_ok_not_cancelled(tmp_path) -> None:
    """After the last byte uvicorn reports every receive() as a disconnect: the watcher, disarmed
    before that write, must not turn a finished request into a cancelled one."""
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 4}) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            streamed = [client.post(CHAT, json=c.chat(f"s{i}", stream=True)) for i in range(4)]
            whole = [client.post(CHAT, json=c.chat(f"w{i}")) for i in range(4)]
            answers = await asyncio.gather(*streamed, *whole)
            assert [r.status_code for r in answers] == [200] * 8
            assert all(r.text.endswith("data: [DONE]\n\n") for r in answers[:4])
            await wait_until(lambda: _requests(client, c.model, "ok"))
            assert await _requests(client, c.model, "ok") == 8
            assert await _requests(client, c.model, "cancelled") == 0
