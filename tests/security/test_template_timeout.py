"""Rendering a chat template in the router is bounded in time (issue 13): a template that loops long is
cut at ``template_render_timeout_s`` with a 400 ``invalid_prompt``, the engine never sees the request,
and the router goes on answering meanwhile. Real router, real tokenizer (the default model's),
trusted client templates (the operator's opt-in), stand-in engine."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from tests.security.support import router

CHAT = "/v1/chat/completions"
NESTED_RANGES = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
)
"""10^10 iterations: hours, were it not cut."""
OVER_THE_MESSAGES = (
    "{% for i in range(100000) %}{% for m in messages %}{% for c in m['content'] %}{{ c }}{% endfor %}"
    "{% endfor %}{% endfor %}"
)
"""Loops over the request itself: 10^8 characters out, and as many in memory."""


async def test_a_template_that_loops_long_is_cut_at_the_bound(tmp_path: Path) -> None:
    async with (
        router(tmp_path, trust_request_chat_template=True, tokenize="always", template_render_timeout_s=0.5) as r,
        httpx.AsyncClient(base_url=r.url, timeout=60) as client,
    ):
        # The first request loads the tokenizer (seconds on a busy host): not part of what is timed.
        assert (await client.post(CHAT, json=r.chat("hi"))).status_code == 200
        for template in (NESTED_RANGES, OVER_THE_MESSAGES):
            started = time.monotonic()
            slow = asyncio.create_task(client.post(CHAT, json=r.chat("x" * 1000, chat_template=template)))
            await asyncio.sleep(0.1)
            # The event loop is free meanwhile: a client template renders in a thread.
            t0 = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            assert time.monotonic() - t0 < 1.0
            resp = await slow
            elapsed = time.monotonic() - started
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["code"] == "invalid_prompt" and "longer than" in error["message"]
            assert elapsed < 5, elapsed
        # The model's own template (its environment bound too) renders as before.
        resp = await client.post(CHAT, json=r.chat("hi"))
        assert resp.status_code == 200, resp.text
        assert r.engine is not None and len(r.engine.bodies()) == 2
