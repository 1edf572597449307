"""Layer-wise P/D (issue 19) on the session cluster's real engines: both legs sent at once, the decode
node pulling each layer while the prefill computes it. Its answers equal colocated ones token for token
(float32, greedy), and each came from a pull that delivered every block, not from a recompute."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.e2e.conftest import NODE_BASE, LiveCluster, engine_metric, wait_for
from tests.e2e.prompts import CHATS
from tests.support.layerwise import layerwise_chat

pytestmark = pytest.mark.e2e
MAX_TOKENS = 24


def _body(cluster: LiveCluster, messages: list[dict], tag: str) -> dict:
    """A fresh first block (``tag``), so that neither node's prefix cache has seen the prompt: the
    decode node pulls every block, and the prefill node computes them."""
    first = {**messages[0], "content": f"[{tag}] {messages[0]['content']}"}
    return {
        "model": cluster.model,
        "messages": [first, *messages[1:]],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_layerwise_pd_equals_colocated_token_for_token(cluster: LiveCluster, transport: str) -> None:
    for messages in CHATS:
        body = _body(cluster, messages, uuid.uuid4().hex[:8])
        colo = httpx.post(
            f"{cluster.url}/v1/chat/completions",
            headers={"x-tandem-route": "colocated"},
            json=body,
            timeout=300,
        )
        assert colo.status_code == 200, colo.text
        resp = layerwise_chat(cluster.prefill_url, cluster.decode_url, NODE_BASE, body, transport)
        assert resp.status_code == 200, resp.text
        report = resp.json()["kv_transfer_params"]["tandem_transfer"]
        assert report["ok"] and report["transport"] == transport and report["bytes"] > 0, report
        got, want = resp.json()["choices"][0]["token_ids"], colo.json()["choices"][0]["token_ids"]
        assert got and got == want, f"layer-wise P/D and colocated differ for {messages[-1]['content'][:40]!r}"
    assert wait_for(lambda: engine_metric(cluster.prefill_url, "tandem_kv_leases_active") == 0, timeout_s=30)


def _by_source(url: str) -> dict[str, float]:
    return {
        s: engine_metric(url, "vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


def test_layerwise_through_the_router_equals_colocated_token_for_token(cluster: LiveCluster) -> None:
    """The session cluster's router sends its P/D pairs layer-wise (the default): its answers equal
    colocated ones, streamed or not, and the decode node pulled every prompt token it did not have
    cached rather than computing it."""
    pairs = engine_metric(cluster.url, "tandem_pd_pairs_total", mode="layerwise")
    before = _by_source(cluster.decode_url)
    prompt_tokens = 0
    for messages in CHATS:
        body = _body(cluster, messages, uuid.uuid4().hex[:8])
        colo = httpx.post(
            f"{cluster.url}/v1/chat/completions", headers={"x-tandem-route": "colocated"}, json=body, timeout=300
        )
        pd = httpx.post(
            f"{cluster.url}/v1/chat/completions", headers={"x-tandem-route": "disaggregated"}, json=body, timeout=300
        )
        assert colo.status_code == 200 and pd.status_code == 200, (colo.text, pd.text)
        assert pd.json()["usage"]["tandem"]["mode"] == "disaggregated"
        got, want = pd.json()["choices"][0]["token_ids"], colo.json()["choices"][0]["token_ids"]
        assert got and got == want, f"layer-wise P/D and colocated differ for {messages[-1]['content'][:40]!r}"
        prompt_tokens += pd.json()["usage"]["prompt_tokens"]
    streamed = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        headers={"x-tandem-route": "disaggregated"},
        json={**_body(cluster, CHATS[0], uuid.uuid4().hex[:8]), "stream": True},
        timeout=300,
    )
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
    assert '"error"' not in streamed.text
    assert engine_metric(cluster.url, "tandem_pd_pairs_total", mode="layerwise") == pairs + len(CHATS) + 1
    after = _by_source(cluster.decode_url)
    assert after["local_compute"] == before["local_compute"], "the decode node recomputed a prompt"
    loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
    assert loaded >= 0.5 * prompt_tokens
    assert wait_for(lambda: engine_metric(cluster.prefill_url, "tandem_kv_leases_active") == 0, timeout_s=30)
