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
