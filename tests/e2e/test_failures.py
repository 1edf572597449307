"""Bad input and client disconnects against the live cluster: clear errors, nothing left running."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import LiveCluster, engine_metric, wait_for

pytestmark = pytest.mark.e2e


def _running(url: str) -> float:
    return engine_metric(url, "vllm:num_requests_running") + engine_metric(url, "vllm:num_requests_waiting")


def test_client_disconnect_mid_stream_aborts_on_the_decode_node(cluster: LiveCluster) -> None:
    body = {"model": cluster.model, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{cluster.url}/v1/chat/completions",
                                                           json=body) as resp:
        assert resp.status_code == 200
        chunks = 0
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                chunks += 1
            if chunks >= 3:
                break
        assert _running(cluster.decode_url) >= 1  # it was really generating when we left
    # Leaving the `with` closed the connection mid-stream.
    assert wait_for(lambda: _running(cluster.decode_url) == 0, timeout_s=15), "decode request not aborted"
    assert _running(cluster.prefill_url) == 0
    assert wait_for(lambda: 'status="cancelled"' in httpx.get(f"{cluster.url}/metrics").text, 10)


def test_prompt_beyond_context_window_is_400_and_router_keeps_serving(cluster: LiveCluster) -> None:
    huge = "token " * 9000
    resp = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=60, json={
        "model": cluster.model, "messages": [{"role": "user", "content": huge}], "max_tokens": 4})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    ok = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=60, json={
        "model": cluster.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_engine_refusal_keeps_its_status_in_openai_shape(cluster: LiveCluster) -> None:
    resp = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=60, json={
        "model": cluster.model, "messages": [{"role": "user", "content": "hi"}], "temperature": -1})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and "temperature" in err["message"]
