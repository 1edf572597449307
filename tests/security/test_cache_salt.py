"""Tenants do not share prefix-cache blocks (issue 13): once auth is on, the router gives every engine
leg a ``cache_salt`` of the request's tenant, and keys its own fleet index with the same salt, so a
tenant's cached prefixes neither serve nor reveal themselves to another tenant. Real router, real
tokenizer and template, stand-in engine (which records the bodies it receives)."""

from __future__ import annotations

from pathlib import Path

import httpx

from router.kv_index import BlockHasher
from router.planning.cache_salt import CacheSalts
from router.tokenizer import PromptTokenizer
from tests.security.support import Router, router

CHAT = "/v1/chat/completions"
PROMPT = "the same long shared system prompt " * 20


def test_salts_separate_tenants_and_hide_the_client_salt() -> None:
    salts = CacheSalts(b"k" * 32, frozenset({"team-a", "team-b"}))
    a1 = salts.salt("acme", authenticated=True)
    assert a1 is not None and a1 == salts.salt("acme", authenticated=True)
    assert a1 != salts.salt("globex", authenticated=True)
    assert "acme" not in a1
    # Opted-in tenants share with each other (no tenant part), as everyone does while auth is off.
    assert salts.salt("team-a", authenticated=True) is None and salts.salt("team-b", authenticated=True) is None
    assert salts.salt("anonymous", authenticated=False) is None
    # A client's own salt narrows sharing within its tenant, and never reaches an engine as given.
    mine = salts.salt("acme", authenticated=True, client_salt="x")
    assert mine not in (None, "x", a1)
    assert mine == salts.salt("acme", authenticated=True, client_salt="x")
    assert mine != salts.salt("globex", authenticated=True, client_salt="x")
    # Without a tenant part the client salt is still hashed: nobody can pick the value an engine sees.
    assert salts.salt("anonymous", authenticated=False, client_salt=a1) != a1
    assert CacheSalts(b"j" * 32).salt("acme", authenticated=True) != a1  # keyed by the cluster secret


def _salts(r: Router) -> list[str | None]:
    assert r.engine is not None
    return [b.get("cache_salt") for b in r.engine.bodies()]


async def test_engines_get_a_salt_per_tenant(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        # Auth off: nothing is salted, everyone shares (a single-user cluster keeps its cache).
        assert (await client.post(CHAT, json=r.chat(PROMPT))).status_code == 200
        acme, globex = await r.create_key("acme"), await r.create_key("globex")
        for headers in (acme, acme, globex):
            resp = await client.post(CHAT, json=r.chat(PROMPT), headers=headers)
            assert resp.status_code == 200, resp.text
        # A client's salt does not override its tenant's, and is not forwarded as given.
        resp = await client.post(CHAT, json=r.chat(PROMPT, cache_salt="globex-guess"), headers=acme)
        assert resp.status_code == 200, resp.text
        resp = await client.post(CHAT, json=r.chat(PROMPT, cache_salt=7), headers=acme)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt"
        off, a1, a2, g, a_client = _salts(r)
        assert off is None
        assert a1 is not None and a1 == a2 and g is not None and g != a1
        assert a_client not in (None, "globex-guess", a1, g)
        expected = CacheSalts.from_cluster_secret()
        assert a1 == expected.salt("acme", authenticated=True)
        # The completions route too, streamed or not.
        for stream in (False, True):
            body = {"model": r.model, "prompt": PROMPT, "max_tokens": 4, "stream": stream, "cache_salt": "mine"}
            assert (await client.post("/v1/completions", json=body, headers=globex)).status_code == 200
        assert r.engine is not None
        done = [b["cache_salt"] for b in r.engine.bodies("/v1/completions")]
        assert done[0] == done[1] == expected.salt("globex", authenticated=True, client_salt="mine")


async def test_shared_tenants_opt_in(tmp_path: Path) -> None:
    async with (
        router(tmp_path, shared_cache_tenants=frozenset({"team-a", "team-b"})) as r,
        httpx.AsyncClient(base_url=r.url, timeout=30) as client,
    ):
        for tenant in ("team-a", "team-b", "other"):
            resp = await client.post(CHAT, json=r.chat(PROMPT), headers=await r.create_key(tenant))
            assert resp.status_code == 200, resp.text
        a, b, other = _salts(r)
        assert a is None and b is None and other is not None


async def test_routing_keys_carry_the_tenant_salt(tmp_path: Path) -> None:
    """The fleet index counts a tenant's own blocks only: blocks cached under acme's salt are a hit for
    acme (``usage.tandem.fleet_cached_tokens``) and nothing for globex, with the very same prompt."""
    async with router(tmp_path, tokenize="always") as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        acme, globex = await r.create_key("acme"), await r.create_key("globex")
        assert r.node is not None
        body = r.chat(PROMPT)
        ids = await PromptTokenizer().token_ids(r.node, body)
        assert ids is not None and len(ids) > 3 * r.node.block_size
        salt = CacheSalts.from_cluster_secret().salt("acme", authenticated=True)
        keys = BlockHasher(r.node.block_size).keys(ids, cache_salt=salt)
        r.app.state.index.model(r.model, r.node.block_size).add_blocks(r.node.node_id, keys)

        def fleet_cached(resp: httpx.Response) -> int:
            assert resp.status_code == 200, resp.text
            return int(resp.json()["usage"]["tandem"]["fleet_cached_tokens"] or 0)

        assert fleet_cached(await client.post(CHAT, json=body, headers=acme)) > 0
        assert fleet_cached(await client.post(CHAT, json=body, headers=globex)) == 0
        assert r.engine is not None and r.engine.bodies()[0]["cache_salt"] == salt
