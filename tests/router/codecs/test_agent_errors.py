"""Each API answers a refused request in its own error shape, for every reason the router refuses one: an
unknown model, a bad key, an oversize body, an invalid field, a rate limit, and no capacity (the node's
slots and queue full); a prompt past the context window, which the engine refuses, is in
``tests/e2e/test_agent_apis.py``. Chat Completions and Responses answer OpenAI's
``{"error": {"message", "type", "param", "code"}}``; Messages answers Anthropic's
``{"type": "error", "error": {"type", "message"}}``, with 529 ``overloaded_error`` where the others say
503. A real router over a stand-in engine (``tests.support.standin_cluster``), real Redis and keys."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from contracts.registry import Role
from router.admission.context import AdmissionContext
from tests.router.admission.support import wait_until
from tests.support.standin_cluster import standin_cluster

APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
ANTHROPIC = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
ANTHROPIC |= {422: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def _body(api: str, model: str, text: str) -> dict:
    if api == "chat":
        return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    if api == "responses":
        return {"model": model, "input": text, "max_output_tokens": 4}
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


def _auth(api: str, key: str) -> dict[str, str]:
    # Anthropic's SDK sends its key as x-api-key; OpenAI's as a bearer token
    return {"x-api-key": key} if api == "messages" else {"Authorization": f"Bearer {key}"}


def _assert_shape(api: str, resp: httpx.Response, status: int) -> dict:
    if api == "messages" and status == 503:
        status = 529
    assert resp.status_code == status, f"{api}: {resp.status_code} {resp.text[:300]}"
    body = resp.json()
    if api == "messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == ANTHROPIC[status] and body["error"]["message"], body
        return body["error"]
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], body
    return err


async def _key(c, tenant: str, rpm: int = 0) -> str:  # noqa: ANN001 - StandInCluster
    await c.create_key("ops-first")  # auth on, and the cluster's admin key made
    ctx = await AdmissionContext.create(c.admission, start_writer=False)
    try:
        return (await ctx.keys.create_key(tenant, rpm=rpm, tpm=0))[1]
    finally:
        await ctx.close()


@pytest.mark.parametrize("api", APIS)
async def test_each_refusal_in_the_apis_own_shape(tmp_path, api: str) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, router={"max_body_bytes": 64_000}) as c:
        key, limited = await _key(c, "acme"), await _key(c, "tight", rpm=1)
        path = PATHS[api]
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:

            async def send(body: dict, key: str = key) -> httpx.Response:
                return await client.post(path, json=body, headers=_auth(api, key))

            assert (await send(_body(api, c.model, "fine"))).status_code == 200
            _assert_shape(api, await send(_body(api, "no-such-model", "hi")), 404)
            _assert_shape(api, await send(_body(api, c.model, "hi"), key="tdm-not-a-key"), 401)
            _assert_shape(api, await send(_body(api, c.model, "x" * 100_000)), 413)
            bad_field = await send({**_body(api, c.model, "hi"), "max_tokens": -1, "max_output_tokens": -1})
            # chat answers a schema violation 422, as it always has; the agent APIs 400, as their vendors do
            assert _assert_shape(api, bad_field, 422 if api == "chat" else 400)["type"] == "invalid_request_error"
            assert (await send(_body(api, c.model, "one"), key=limited)).status_code == 200
            limited_out = await send(_body(api, c.model, "two"), key=limited)
            _assert_shape(api, limited_out, 429)
            assert int(limited_out.headers["retry-after"]) >= 1
            assert len(c.engines["n"].received) == 2  # nothing refused reached the engine


@pytest.mark.parametrize("api", APIS)
async def test_no_capacity_is_overloaded_in_the_apis_own_shape(tmp_path, api: str) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, node_max_concurrency=1, node_max_queue=0) as c:
        engine = c.engines["n"]
        engine.close_gate()
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            holding = asyncio.create_task(client.post(PATHS["chat"], json=c.chat("holds the only slot")))
            await wait_until(lambda: len(engine.received) == 1)
            refused = await client.post(PATHS[api], json=_body(api, c.model, "no room"))
            _assert_shape(api, refused, 503)
            assert int(refused.headers["retry-after"]) >= 1
            engine.open_gate()
            assert (await holding).status_code == 200
            assert len(engine.received) == 1
