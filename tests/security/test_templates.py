"""The router renders chat templates itself (to count and route by tokens), so what a client may ask
of that rendering is bounded (issue 13, item 1): no client template unless the operator trusts them,
template arguments from an allowlist, and a prompt the router cannot tokenize is a 400, never served
as 0 tokens past the context check and the token limits. Real tokenizer and template (the default
model's folder), stand-in engine.

With one node and no token limit the router has no use for the tokens (``RouterSettings.tokenize``
auto) and leaves rendering to the engine, which applies the same checks; the tests of the router's own
rendering therefore run with ``tokenize="always"``, and the last test pins down when auto renders."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.security.support import router

CHAT = "/v1/chat/completions"
LONG = "word " * 200  # well over the 64-token window below with the real tokenizer


def _code(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]["code"]


async def test_a_client_chat_template_is_400_unless_trusted(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        resp = await client.post(CHAT, json=r.chat(chat_template=template))
        assert _code(resp, 400) == "chat_template_not_allowed"
        assert r.engine is not None and r.engine.bodies() == []
    async with (
        router(tmp_path, trust_request_chat_template=True, tokenize="always") as r,
        httpx.AsyncClient(base_url=r.url, timeout=30) as client,
    ):
        assert (await client.post(CHAT, json=r.chat(chat_template=template))).status_code == 200
        failing = "{{ raise_exception('refused by template') }}"
        resp = await client.post(CHAT, json=r.chat(chat_template=failing))
        assert _code(resp, 400) == "invalid_prompt"
        assert "refused by template" in resp.json()["error"]["message"]
        assert r.engine is not None and len(r.engine.bodies()) == 1


async def test_template_kwargs_come_from_an_allowlist(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        for kwargs in ({"chat_template": "x"}, {"tools": []}, {"add_generation_prompt": {"a": 1}}, ["x"]):
            resp = await client.post(CHAT, json=r.chat(chat_template_kwargs=kwargs))
            assert _code(resp, 400) == "chat_template_kwargs_not_allowed"
        resp = await client.post(CHAT, json=r.chat(chat_template_kwargs={"enable_thinking": False}))
        assert resp.status_code == 200, resp.text


async def test_add_generation_prompt_is_counted_never_a_free_pass(tmp_path: Path) -> None:
    """Before: the kwarg collided with the router's own argument, rendering failed silently, and the
    prompt went uncounted: no context check, 0 tokens charged, served by the engine."""
    async with (
        router(tmp_path, max_model_len=64, tokenize="always") as r,
        httpx.AsyncClient(base_url=r.url, timeout=30) as client,
    ):
        for value in (True, False):
            resp = await client.post(CHAT, json=r.chat(LONG, chat_template_kwargs={"add_generation_prompt": value}))
            assert _code(resp, 400) == "context_length_exceeded"
        resp = await client.post(CHAT, json=r.chat("hi", chat_template_kwargs={"add_generation_prompt": True}))
        assert resp.status_code == 200, resp.text
        assert r.engine is not None and len(r.engine.bodies()) == 1


async def test_a_prompt_the_router_cannot_render_is_400(tmp_path: Path) -> None:
    async with router(tmp_path, tokenize="always") as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        # Both at once cannot render (transformers and vLLM refuse the pair): the router must not count it as 0.
        body = {
            "model": r.model,
            "max_tokens": 4,
            "messages": [{"role": "assistant", "content": "x"}],
            "continue_final_message": True,
            "add_generation_prompt": True,
        }
        resp = await client.post(CHAT, json=body)
        assert _code(resp, 400) == "invalid_prompt"
        assert r.engine is not None and r.engine.bodies() == []


async def test_auto_renders_only_when_a_limit_or_a_routing_choice_needs_the_tokens(tmp_path: Path) -> None:
    """tokenize=auto with one node: no token limit, nothing to decide, so the prompt goes to the engine
    unrendered (the engine checks the window); with a token limit the router must count it first, so
    the same over-long prompt is refused before any node works and never charged as 0 tokens."""
    async with router(tmp_path, max_model_len=64) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        resp = await client.post(CHAT, json=r.chat(LONG))
        assert resp.status_code == 200, resp.text  # the stand-in serves it; a real engine answers the 400
        assert r.engine is not None and len(r.engine.bodies()) == 1
        resp = await client.post(CHAT, json=r.chat(max_tokens=64))  # needs no tokens: still the router's
        assert _code(resp, 400) == "context_length_exceeded"
        assert len(r.engine.bodies()) == 1
    async with (
        router(tmp_path, max_model_len=64, admission_overrides={"anonymous_tpm": 100_000}) as r,
        httpx.AsyncClient(base_url=r.url, timeout=30) as client,
    ):
        resp = await client.post(CHAT, json=r.chat(LONG))
        assert _code(resp, 400) == "context_length_exceeded"
        assert r.engine is not None and r.engine.bodies() == []
