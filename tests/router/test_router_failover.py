"""A node whose engine is gone (connections refused) costs no request: the leg is served once more on
another node before any byte reached the client, and the node is left out of routing at once instead
of when its registry entry lapses. Stand-in engines (the labelled test double) behind the real router."""

from __future__ import annotations

import httpx

from contracts.registry import Role
from tests.support.standin_cluster import metric, standin_cluster

CHAT = "/v1/chat/completions"


async def _answered_colocated(client: httpx.AsyncClient, body: dict) -> None:
    """A 200: a stream that ends with [DONE] and no error event, or an answer served colocated."""
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    else:
        assert r.json()["usage"]["tandem"]["mode"] == "colocated"


async def test_a_dead_colocated_node_is_routed_around_and_marked_down(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"live": Role.BOTH}, dead={"gone": Role.BOTH}, policy="round_robin") as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            for i in range(6):  # round robin would send every other request to the dead node
                await _answered_colocated(client, c.chat(f"q{i}", stream=i % 2 == 1))
            assert len(c.engines["live"].bodies()) == 6  # every request was answered by the live node
            # Only the first request found the dead node: after it, the node was out of routing.
            page = (await client.get("/metrics")).text
            assert metric(page, "tandem_prefill_fallbacks_total") == 1.0


async def test_with_no_other_node_the_failure_is_a_502(tmp_path) -> None:
    async with standin_cluster(tmp_path, {}, dead={"gone": Role.BOTH}) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            r = await client.post(CHAT, json=c.chat("alone"))
            assert r.status_code == 502 and r.json()["error"]["message"]


async def test_a_dead_decode_node_with_only_a_prefill_node_left_is_served_by_the_prefill_node(tmp_path) -> None:
    # What a killed decode engine leaves: the request that found it dead before its first token is
    # served whole by the prefill engine, streamed or not, and never reaches the client as a 5xx.
    async with standin_cluster(tmp_path, {"pre": Role.PREFILL}, dead={"dec": Role.DECODE}) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            for i in range(2):
                await _answered_colocated(client, c.chat(f"alone {i}", stream=i == 1))
            # The first went P/D (its prefill leg on "pre"), found "dec" dead and was served whole by "pre";
            # "dec" was then out of routing, so the second went straight to "pre" alone.
            whole = [b for b in c.engines["pre"].bodies() if "kv_transfer_params" not in b]
            assert len(whole) == 2


async def test_a_dead_decode_node_that_was_to_prefill_itself_falls_back_to_the_prefill_node(tmp_path) -> None:
    # No prefill leg (the decode node was to serve the request alone): the retry finds no colocated or
    # decode node, and a prefill node serves it rather than the client getting the 502.
    async with standin_cluster(tmp_path, {"pre": Role.PREFILL}, dead={"dec": Role.DECODE}) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            r = await client.post(CHAT, json=c.chat("alone"), headers={"x-tandem-route": "colocated"})
            assert r.status_code == 200, r.text
            assert [b for b in c.engines["pre"].bodies() if "kv_transfer_params" not in b]
