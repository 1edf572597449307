"""Fields only the router may set never reach an engine from a client, and the path-forcing header
is an operator's tool (issue 13, item 1). Observed on the engine side: the stand-in engine records
every body it receives."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.security.support import router

CHAT = "/v1/chat/completions"
ATTACKER = {
    "do_remote_prefill": True,
    "remote_host": "203.0.113.9",
    "remote_port": 4444,
    "remote_block_ids": [1, 2, 3],
    "remote_engine_id": "evil",
}


async def test_client_kv_transfer_params_never_reach_the_engine(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        for path, body in ((CHAT, r.chat()), ("/v1/completions", {"model": r.model, "prompt": "hi", "max_tokens": 4})):
            for stream in (False, True):
                resp = await client.post(
                    path,
                    json={
                        **body,
                        "stream": stream,
                        "kv_transfer_params": ATTACKER,
                        "request_id": "someone-elses",
                        "priority": -100,
                    },
                    headers={"x-tandem-route": "colocated"},
                )
                assert resp.status_code == 200, resp.text
        assert r.engine is not None
        seen = r.engine.bodies() + r.engine.bodies("/v1/completions")
        assert len(seen) == 4
        for body in seen:
            assert "kv_transfer_params" not in body and "request_id" not in body and "priority" not in body
            assert "203.0.113.9" not in str(body)


async def test_route_header_only_for_admin_keys_once_auth_is_on(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        forced = {"x-tandem-route": "colocated"}
        assert (await client.post(CHAT, json=r.chat(), headers=forced)).status_code == 200  # auth off
        user = await r.create_key("acme")
        admin = await r.create_key("ops", admin=True)
        resp = await client.post(CHAT, json=r.chat(), headers={**user, **forced})
        assert resp.status_code == 403, resp.text
        assert resp.json()["error"]["param"] == "x-tandem-route"
        assert (await client.post(CHAT, json=r.chat(), headers=user)).status_code == 200
        assert (await client.post(CHAT, json=r.chat(), headers={**admin, **forced})).status_code == 200


async def test_route_header_setting_always(tmp_path: Path) -> None:
    async with router(tmp_path, route_header="always") as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        user = await r.create_key("acme")
        resp = await client.post(CHAT, json=r.chat(), headers={**user, "x-tandem-route": "colocated"})
        assert resp.status_code == 200, resp.text
