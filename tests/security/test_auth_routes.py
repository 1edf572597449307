"""Once a key exists, every route but /health needs one (the OpenAPI document and its viewers too, and
the document says in each auth mode what the server then does); /metrics and /cluster need an admin key;
feedback is accepted only from the tenant that owns the response (issue 13, item 2). Real router,
real Redis and key store, stand-in engine."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from tests.security.support import router

CHAT = "/v1/chat/completions"


async def test_every_route_but_health_needs_a_key_once_one_exists(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        routes = [
            ("GET", "/v1/models", None),
            ("GET", "/metrics", None),
            ("GET", "/cluster", None),
            ("POST", "/v1/feedback", {"response_id": "x", "rating": 1}),
            ("POST", CHAT, r.chat()),
            ("POST", "/v1/completions", {"model": r.model, "prompt": "hi"}),
            ("GET", "/v1/sessions/s1", None),
            ("DELETE", "/v1/sessions/s1", None),
            # The document and its viewers follow the API's rule (they were FastAPI's, open to anyone).
            ("GET", "/openapi.json", None),
            ("GET", "/docs", None),
            ("GET", "/redoc", None),
        ]
        assert (await client.get("/v1/models")).status_code == 200  # no key yet: auth off
        await r.create_key("acme")
        for method, path, body in routes:
            resp = await client.request(method, path, json=body)
            assert resp.status_code == 401, (method, path, resp.text)
            assert resp.json()["error"]["type"] == "authentication_error"
            bad = await client.request(method, path, json=body, headers={"Authorization": "Bearer tdm-nope"})
            assert bad.status_code == 401, (method, path, bad.text)
        assert (await client.get("/health")).status_code == 200


async def test_the_document_says_what_each_auth_mode_does(tmp_path: Path) -> None:
    """Auth off: every route but /health takes a key or none (OpenAPI's ``{}`` beside the scheme), as
    the server does. Auth on: the key is required, and the document itself needs one."""
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        for path in ("/docs", "/redoc"):
            page = await client.get(path)
            assert page.status_code == 200 and "/openapi.json" in page.text, path
        opened = (await client.get("/openapi.json")).json()
        user = await r.create_key("acme")
        closed = (await client.get("/openapi.json", headers=user)).json()
        assert opened["paths"].keys() == closed["paths"].keys()
        for path, operations in closed["paths"].items():
            for method, op in operations.items():
                if path == "/health":
                    assert op["security"] == opened["paths"][path][method]["security"] == []
                else:
                    assert op["security"] == [{"apiKey": []}], (method, path)
                    assert opened["paths"][path][method]["security"] == [{"apiKey": []}, {}], (method, path)
        assert (await client.get("/docs", headers=user)).status_code == 200


async def test_metrics_and_cluster_need_an_admin_key(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        user = await r.create_key("acme")
        admin = await r.create_key("ops", admin=True)
        assert (await client.get("/v1/models", headers=user)).status_code == 200
        for path in ("/metrics", "/cluster"):
            resp = await client.get(path, headers=user)
            assert resp.status_code == 403, resp.text
            assert resp.json()["error"]["code"] == "permission_denied"
            assert (await client.get(path, headers=admin)).status_code == 200
        nodes = (await client.get("/cluster", headers=admin)).json()["nodes"]
        assert len(nodes) == 1


async def test_feedback_only_from_the_tenant_that_owns_the_response(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        acme, globex = await r.create_key("acme"), await r.create_key("globex")
        answer = await client.post(CHAT, json=r.chat(), headers=acme)
        assert answer.status_code == 200, answer.text
        fb = {"response_id": answer.json()["id"], "rating": 1, "comment": "good"}
        end = time.monotonic() + 10
        while (own := await client.post("/v1/feedback", json=fb, headers=acme)).status_code == 404:
            assert time.monotonic() < end, "the response was never indexed"
            await asyncio.sleep(0.05)  # the response index is written off the request's path
        assert own.status_code == 202, own.text
        other = await client.post("/v1/feedback", json=fb, headers=globex)
        assert other.status_code == 404, other.text
        assert other.json()["error"]["message"] == f"No response with id `{fb['response_id']}`."
