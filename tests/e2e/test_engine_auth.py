"""A real engine of a node answers only its cluster (issues 13 and 35): started with ``VLLM_API_KEY`` by its
node agent and with the agent's guard (``node_agent.engine_guard``) in front of every path, reached through
the router (which sends the key), refused when reached directly without it: ``/v1/*`` (vLLM's own check) and
every other path, ``/invocations`` (generation with a caller's body) and ``/tokenize`` among them. Liveness
and metrics stay open."""

from __future__ import annotations

import httpx

from contracts.secret import engine_auth_headers
from tests.e2e.conftest import LiveCluster


def test_engine_ports_refuse_callers_without_the_key(cluster: LiveCluster) -> None:
    body = {"model": cluster.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for engine in (cluster.prefill_url, cluster.decode_url, cluster.both_url):
        assert httpx.post(f"{engine}/v1/chat/completions", json=body, timeout=60).status_code == 401
        assert httpx.get(f"{engine}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{engine}/health", timeout=10).status_code == 200
    key = engine_auth_headers(loopback_only=True)
    assert httpx.get(f"{cluster.both_url}/v1/models", headers=key, timeout=10).status_code == 200
    resp = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text


def test_every_engine_path_but_liveness_and_metrics_needs_the_key(cluster: LiveCluster) -> None:
    """vLLM guards ``/v1`` only; ``/invocations`` runs chat with any body and ``/tokenize`` reads the
    model's vocabulary: both were served to anyone on the port before the guard."""
    chat = {"model": cluster.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    tokenize = {"model": cluster.model, "prompt": "hello"}
    key = engine_auth_headers(loopback_only=True)
    wrong = {"Authorization": "Bearer not-the-engine-key"}
    for engine in (cluster.prefill_url, cluster.decode_url, cluster.both_url):
        for headers in ({}, wrong):
            refused = httpx.post(f"{engine}/invocations", json=chat, headers=headers, timeout=60)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert httpx.post(f"{engine}/tokenize", json=tokenize, headers=headers, timeout=30).status_code == 401
            assert httpx.get(f"{engine}/version", headers=headers, timeout=10).status_code == 401
        assert httpx.get(f"{engine}/metrics", timeout=10).status_code == 200
    served = httpx.post(f"{cluster.both_url}/tokenize", json=tokenize, headers=key, timeout=30)
    assert served.status_code == 200 and served.json()["tokens"], served.text
    answered = httpx.post(f"{cluster.both_url}/invocations", json=chat, headers=key, timeout=300)
    assert answered.status_code == 200, answered.text
