"""Bad input and client disconnects against the live cluster: clear errors, nothing left running."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import LiveCluster, engine_metric, wait_for

pytestmark = pytest.mark.e2e


def _running(url: str) -> float:
    return engine_metric(url, "vllm:num_requests_running") + engine_metric(url, "vllm:num_requests_waiting")


def _generated(urls: tuple[str, ...]) -> float:
    return sum(engine_metric(u, "vllm:generation_tokens_total") for u in urls)


# How long an engine may take to act on an abort: it does so between steps, and one prefill step of a
# long prompt lasts over a minute on a slow 2-core host. Whether it aborted is judged by the tokens it
# generated meanwhile, not by how soon it stopped, so the test holds on fast and slow hosts alike.
ABORT_WAIT_S = 600


def test_client_disconnect_mid_stream_aborts_on_the_decode_node(cluster: LiveCluster) -> None:
    body = {
        "model": cluster.model,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 1000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{cluster.url}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        chunks = 0
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                chunks += 1
            if chunks >= 3:
                # Checked before leaving the loop: breaking out of iter_lines closes the connection at once.
                assert wait_for(lambda: _running(cluster.decode_url) >= 1, timeout_s=60)  # it is generating
                generated = _generated((cluster.decode_url,))
                break
    # The connection is closed mid-stream.
    assert wait_for(lambda: _running(cluster.decode_url) == 0, timeout_s=ABORT_WAIT_S), "decode request kept"
    # Aborted, not finished: far fewer than its 1000 tokens came after the client left.
    assert _generated((cluster.decode_url,)) - generated < 500
    assert _running(cluster.prefill_url) == 0
    assert wait_for(lambda: 'status="cancelled"' in httpx.get(f"{cluster.url}/metrics").text, 10)


def test_prompt_beyond_context_window_is_400_and_router_keeps_serving(cluster: LiveCluster) -> None:
    huge = "token " * 9000
    resp = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        timeout=60,
        json={"model": cluster.model, "messages": [{"role": "user", "content": huge}], "max_tokens": 4},
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    ok = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        timeout=60,
        json={"model": cluster.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3},
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_engine_refusal_keeps_its_status_in_openai_shape(cluster: LiveCluster) -> None:
    resp = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        timeout=60,
        json={"model": cluster.model, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    )
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and "temperature" in err["message"]


def _router_sum(cluster: LiveCluster, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def test_a_client_gone_before_the_first_byte_leaves_no_slot_and_no_engine_request(cluster: LiveCluster) -> None:
    """The client leaves while its prompt is being prefilled, before the router has sent a byte: the
    request's owner (router.edge.exchange) lets go of everything, once. No engine keeps the request and
    the router holds no node slot and counts nothing in flight."""
    import socket
    from urllib.parse import urlsplit

    engines = (cluster.prefill_url, cluster.decode_url, cluster.both_url)
    assert wait_for(lambda: sum(_running(u) for u in engines) == 0, timeout_s=30)
    generated = _generated(engines)
    cancelled_before = sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{cluster.url}/metrics").text.splitlines()
        if line.startswith("tandem_requests_total") and 'status="cancelled"' in line
    )
    long_prompt = " ".join(f"w{i}" for i in range(1300))  # ~5.6k tokens: seconds of prefill here
    body = httpx.Request(
        "POST",
        "http://x/v1/chat/completions",
        json={
            "model": cluster.model,
            "messages": [{"role": "user", "content": long_prompt}],
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        },
    ).read()
    url = urlsplit(cluster.url)
    sock = socket.create_connection((url.hostname, url.port))
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        # The engine has the prompt: the router routed it and holds its slots, and has sent nothing yet.
        # (An engine publishes its counts after each step, and one prefill step can last a minute on a
        # slow host: hence the long wait.)
        assert wait_for(lambda: sum(_running(u) for u in engines) >= 1, timeout_s=300, interval_s=0.05)
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(1)  # not a byte of the answer so far
    finally:
        sock.close()
    assert wait_for(lambda: sum(_running(u) for u in engines) == 0, timeout_s=ABORT_WAIT_S), "an engine kept it"
    assert _generated(engines) - generated < 100  # aborted in its prefill: not its 200 tokens
    assert wait_for(lambda: _router_sum(cluster, "tandem_admission_slots_in_use") == 0, timeout_s=10)
    assert _router_sum(cluster, "tandem_node_inflight_requests") == 0
    assert wait_for(
        lambda: (
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in httpx.get(f"{cluster.url}/metrics").text.splitlines()
                if line.startswith("tandem_requests_total") and 'status="cancelled"' in line
            )
            == cancelled_before + 1
        ),
        timeout_s=10,
    )
