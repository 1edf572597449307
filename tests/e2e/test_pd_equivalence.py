"""Disaggregated answers equal colocated ones token for token (float32, greedy), and the decode node
really loaded the prompt's KV from the prefill node instead of computing it."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import LiveCluster, prompt_tokens_by_source
from tests.e2e.prompts import CHATS, COMPLETION_PROMPT, LONG_CHAT_INDEX

pytestmark = pytest.mark.e2e
MAX_TOKENS = 24


def _chat(cluster: LiveCluster, messages: list[dict], route: str) -> dict:
    resp = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        headers={"x-tandem-route": route},
        timeout=300,
        json={
            "model": cluster.model,
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_disaggregated_equals_colocated_token_for_token(cluster: LiveCluster) -> None:
    assert _chat(cluster, CHATS[LONG_CHAT_INDEX], "colocated")["usage"]["prompt_tokens"] > 1000
    before = prompt_tokens_by_source(cluster.decode_url)
    pd_prompt_tokens = 0
    for messages in CHATS:
        pd = _chat(cluster, messages, "disaggregated")
        colo = _chat(cluster, messages, "colocated")
        pd_ids, colo_ids = pd["choices"][0]["token_ids"], colo["choices"][0]["token_ids"]
        assert pd_ids and len(pd_ids) == pd["usage"]["completion_tokens"]
        assert pd_ids == colo_ids, f"P/D and colocated differ for {messages[-1]['content'][:40]!r}"
        assert pd["choices"][0]["message"]["content"] == colo["choices"][0]["message"]["content"]
        pd_prompt_tokens += pd["usage"]["prompt_tokens"]
    after = prompt_tokens_by_source(cluster.decode_url)
    loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
    reused = after["local_cache_hit"] - before["local_cache_hit"]
    computed = after["local_compute"] - before["local_compute"]
    # Every prompt token of every P/D request came over the KV transfer (or, for a shared prefix,
    # from the decode node's own prefix cache); the decode node computed none of them itself.
    assert computed == 0
    assert loaded + reused == pd_prompt_tokens
    assert loaded >= 0.5 * pd_prompt_tokens


def test_disaggregated_completion_equals_colocated(cluster: LiveCluster) -> None:
    def complete(route: str) -> dict:
        resp = httpx.post(
            f"{cluster.url}/v1/completions",
            headers={"x-tandem-route": route},
            timeout=120,
            json={
                "model": cluster.model,
                "prompt": COMPLETION_PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        assert resp.status_code == 200, resp.text
        return resp.json()

    pd, colo = complete("disaggregated"), complete("colocated")
    assert pd["choices"][0]["token_ids"] == colo["choices"][0]["token_ids"]
    assert pd["choices"][0]["text"] == colo["choices"][0]["text"] != ""
