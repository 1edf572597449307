"""Layer-wise pairs in the router's real request path (``router.planning.layerwise``): both legs leave at once and
name one transfer id the router chose, the decode leg naming the prefill node's block server as the
registry advertises it; a prefill leg that fails cancels the decode leg and the request follows the
prefill fallback; the setting off, or a node that advertises no block server, keeps pairs sequential.
STAND-IN engines (``bench.standin_engine``: no model, no KV) whose gates hold a leg as long as a test
needs; what real engines do with the legs is tests/e2e/test_layerwise_router.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from contracts.registry import Role
from contracts.transfer import LAYERWISE_ID_KEY
from tests.router.admission.support import wait_until
from tests.support.standin_cluster import metric, standin_cluster

CHAT = "/v1/chat/completions"
PD = {"x-tandem-route": "disaggregated"}


def _params(body: dict) -> dict:
    return body.get("kv_transfer_params") or {}


@pytest.mark.parametrize("stream", [False, True])
async def test_the_decode_leg_leaves_before_the_prefill_answers_and_names_its_transfer(tmp_path, stream: bool) -> None:
    roles = {"pre": Role.PREFILL, "dec": Role.DECODE}
    async with standin_cluster(tmp_path, roles, kv_connector="tandem") as c:
        pre, dec = c.engines["pre"], c.engines["dec"]
        pre.close_gate()  # the prefill leg is held: only a pair sent at once reaches the decode node now
        # The decode leg is held too: a stand-in decode node answers without waiting for any KV, and a
        # decode leg that finished leaves its prefill leg abandoned, perhaps before it reached the node.
        dec.close_gate()
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            answer = asyncio.create_task(client.post(CHAT, json=c.chat("lw", stream=stream), headers=PD))
            await wait_until(lambda: len(dec.bodies()) == 1 and len(pre.bodies()) == 1)
            assert pre.in_flight == 1  # still unanswered
            prefill, decode = _params(pre.bodies()[0]), _params(dec.bodies()[0])
            assert prefill["do_remote_decode"] and prefill[LAYERWISE_ID_KEY].startswith("lw-")
            assert decode["layerwise"] is True and decode["transfer_id"] == prefill[LAYERWISE_ID_KEY]
            assert decode["remote_block_ids"] == [] and decode["remote_host_id"] == "standin-host"
            assert decode["remote_endpoints"]["tcp"].startswith("tcp://127.0.0.1:")
            pre.open_gate()
            dec.open_gate()
            r = await answer
            assert r.status_code == 200, r.text
            if stream:
                assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
            else:
                assert r.json()["usage"]["tandem"]["mode"] == "disaggregated"
        assert dec.bodies()[0]["max_tokens"] == 8 and pre.bodies()[0]["max_tokens"] == 1


@pytest.mark.parametrize(("status", "fallback"), [(500, "local"), (500, "error"), (400, "local")])
async def test_a_failed_prefill_leg_cancels_the_decode_leg(tmp_path, status: int, fallback: str) -> None:
    """500: the request falls back to the decode node, which serves it without a transfer, or under the
    error policy is that error; 400 (the client's request is at fault): that error, as a sequential pair
    answers it."""
    roles = {"pre": Role.PREFILL, "dec": Role.DECODE}
    router = {"prefill_fallback": fallback}
    async with standin_cluster(tmp_path, roles, kv_connector="tandem", router=router) as c:
        pre, dec = c.engines["pre"], c.engines["dec"]
        pre.close_gate()
        dec.close_gate()
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            answer = asyncio.create_task(client.post(CHAT, json=c.chat("refused"), headers=PD))
            await wait_until(lambda: len(dec.bodies()) == 1 and len(pre.bodies()) == 1)
            pre.prefill_error = status
            pre.open_gate()  # the prefill leg fails while the decode leg waits for its KV
            if fallback == "local" and status == 500:
                await wait_until(lambda: len(dec.bodies()) == 2)
                dec.open_gate()
            r = await answer
            dec.open_gate()
            page = (await client.get("/metrics")).text
        first = dec.bodies()[0]
        assert _params(first)["layerwise"] is True
        if fallback == "error" or status == 400:
            assert r.status_code == status, r.text  # the engine's own status, as for a sequential pair
            assert r.json()["error"]["message"] == "stand-in prefill failed", r.text
            assert len(dec.bodies()) == 1  # the layer-wise leg only, cancelled
            return
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["tandem"]["mode"] == "colocated"
        assert "kv_transfer_params" not in dec.bodies()[1]  # the fallback: no transfer
        assert metric(page, "tandem_prefill_fallbacks_total") == 1.0


@pytest.mark.parametrize("how", ["setting off", "no block server"])
async def test_pairs_stay_sequential_without_the_setting_or_a_block_server(tmp_path, how: str) -> None:
    roles = {"pre": Role.PREFILL, "dec": Role.DECODE}
    kw: dict = {"router": {"layerwise": False}, "kv_connector": "tandem"} if how == "setting off" else {}
    async with standin_cluster(tmp_path, roles, **kw) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            r = await client.post(CHAT, json=c.chat("seq"), headers=PD)
            assert r.status_code == 200, r.text
        prefill, decode = _params(c.engines["pre"].bodies()[0]), _params(c.engines["dec"].bodies()[0])
        assert LAYERWISE_ID_KEY not in prefill
        assert decode["stand_in"] is True  # the prefill leg's answer, carried over: sent after it
