"""A real engine of a node answers ``/v1/*`` only with the cluster's engine key (issue 13): started with
``VLLM_API_KEY`` by its node agent, reached through the router (which sends the key), refused when
reached directly without it."""

from __future__ import annotations

import httpx

from kv_transfer.auth import engine_auth_headers
from tests.e2e.conftest import LiveCluster


def test_engine_ports_refuse_callers_without_the_key(cluster: LiveCluster) -> None:
    body = {"model": cluster.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for engine in (cluster.prefill_url, cluster.decode_url, cluster.both_url):
        assert httpx.post(f"{engine}/v1/chat/completions", json=body, timeout=60).status_code == 401
        assert httpx.get(f"{engine}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{engine}/health", timeout=10).status_code == 200  # vLLM guards /v1/* only
    key = engine_auth_headers(loopback_only=True)
    assert httpx.get(f"{cluster.both_url}/v1/models", headers=key, timeout=10).status_code == 200
    resp = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
