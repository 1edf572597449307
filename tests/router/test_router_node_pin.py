"""``x-tandem-node``: an operator pins a request to a named node (benchmark probes, debugging one node).
The pinned node serves the request alone whatever the policy would choose, the request never moves to
another node, and every way the header can be wrong is an OpenAI-format error naming it. Stand-in
engines (the labelled test double) behind the real router."""

from __future__ import annotations

import httpx

from contracts.registry import Role
from tests.support.standin_cluster import standin_cluster

CHAT = "/v1/chat/completions"
PIN = "x-tandem-node"


def _error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == PIN and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


async def test_every_pinned_request_is_served_by_the_named_node_alone(tmp_path) -> None:
    # round_robin alone would send half of them to "a"; the same prompt would go where it is cached.
    roles = {"a": Role.BOTH, "b": Role.BOTH}
    async with standin_cluster(tmp_path, roles, policy="round_robin") as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            pin = {PIN: c.node_ids["b"]}
            for i in range(4):
                r = await client.post(CHAT, json=c.chat("same prompt", stream=i % 2 == 1), headers=pin)
                assert r.status_code == 200, r.text
            r = await client.post(CHAT, json=c.chat("same prompt"), headers=pin)
            tandem = r.json()["usage"]["tandem"]
            assert tandem["reason_code"] == "pinned" and tandem["mode"] == "colocated"
            assert len(c.engines["b"].bodies()) == 5 and c.engines["a"].bodies() == []


async def test_a_pinned_request_whose_node_fails_is_not_moved_and_the_node_then_answers_503(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"live": Role.BOTH}, dead={"gone": Role.BOTH}) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            pin = {PIN: c.node_ids["gone"]}
            r = await client.post(CHAT, json=c.chat("q"), headers=pin)
            assert r.status_code == 502, r.text  # an unpinned request would have been served by "live"
            assert c.engines["live"].bodies() == []
            # The failed leg marked the node down: pinned requests are refused at once, with a retry hint.
            r = await client.post(CHAT, json=c.chat("q", stream=True), headers=pin)
            _error(r, 503, "node_unavailable")
            assert int(r.headers["retry-after"]) >= 1
            assert (await client.post(CHAT, json=c.chat("q"))).status_code == 200  # unpinned: served


async def test_bad_pins_are_openai_errors_naming_the_header(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"a": Role.BOTH}) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            _error(await client.post(CHAT, json=c.chat("q"), headers={PIN: "no-such-node"}), 404, "node_not_found")
            _error(await client.post(CHAT, json=c.chat("q"), headers={PIN: "a b"}), 400)
            _error(await client.post(CHAT, json=c.chat("q"), headers={PIN: "x" * 300}), 400)
            both = {PIN: c.node_ids["a"], "x-tandem-route": "disaggregated"}
            _error(await client.post(CHAT, json=c.chat("q"), headers=both), 400)
            assert c.engines["a"].bodies() == []


async def test_a_node_of_another_model_is_not_found_for_this_one(tmp_path) -> None:
    roles = {"a": Role.BOTH, "other": Role.BOTH}
    async with standin_cluster(tmp_path, roles, models={"other": "another-model"}) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            r = await client.post(CHAT, json=c.chat("q"), headers={PIN: c.node_ids["other"]})
            _error(r, 404, "node_not_found")
            assert c.engines["other"].bodies() == []


async def test_pinning_needs_an_admin_key_once_auth_is_on(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"a": Role.BOTH, "b": Role.BOTH}) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            user = {"Authorization": f"Bearer {await c.create_key('acme')}"}
            admin = {"Authorization": f"Bearer {await c.create_key('ops', admin=True)}"}
            pin = {PIN: c.node_ids["a"]}
            _error(await client.post(CHAT, json=c.chat("q"), headers={**user, **pin}), 403)
            r = await client.post(CHAT, json=c.chat("q"), headers={**admin, **pin})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["tandem"]["reason_code"] == "pinned"
