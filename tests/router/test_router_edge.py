"""The router's edge without engines: every bad input gets an OpenAI-format error with the right
status, and the router keeps serving. Real Redis registry; nodes registered at a closed port so any
request that wrongly reaches a node shows up as a 502."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from contracts.registry import NodeInfo, NodeRegistry, Role
from node_agent.model import default_model_dir
from router.edge.app import create_app
from router.settings import RouterSettings

MODEL = "tiny"
DEAD_URL = "http://127.0.0.1:1"


def _run(coro):  # noqa: ANN001, ANN202
    return asyncio.run(coro)


async def _reset_and_register(url: str, nodes: list[NodeInfo]) -> None:
    client = aioredis.from_url(url)
    await client.flushdb()
    reg = NodeRegistry(client, ttl_s=60)
    for n in nodes:
        await reg.register(n)
    await client.aclose()


def _node(node_id: str, role: Role, max_model_len: int = 2048) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=role,
        model=MODEL,
        url=DEAD_URL,
        block_size=16,
        max_model_len=max_model_len,
        kv_connector="none",
        model_path=str(default_model_dir()),
    )


@pytest.fixture
def client_with(redis_unit_url: str):  # noqa: ANN201
    def make(nodes: list[NodeInfo], **settings: object) -> TestClient:
        _run(_reset_and_register(redis_unit_url, nodes))
        return TestClient(create_app(RouterSettings(redis_url=redis_unit_url, registry_refresh_s=60, **settings)))  # type: ignore[arg-type]

    yield make
    _run(_reset_and_register(redis_unit_url, []))


@pytest.fixture
def client(client_with) -> Iterator[TestClient]:  # noqa: ANN001
    with client_with([_node("both-0", Role.BOTH, max_model_len=256)]) as c:
        yield c


def _assert_openai_error(resp, status: int, code: str | None = None) -> dict:  # noqa: ANN001
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_malformed_json_is_400(client: TestClient) -> None:
    _assert_openai_error(client.post("/v1/chat/completions", content=b'{"model": '), 400, "invalid_json")
    _assert_openai_error(client.post("/v1/completions", content=b"[1, 2]"), 400, "invalid_json")


def test_missing_messages_and_bad_fields_are_422(client: TestClient) -> None:
    err = _assert_openai_error(client.post("/v1/chat/completions", json={"model": MODEL}), 422)
    assert err["param"] == "messages"
    _assert_openai_error(client.post("/v1/chat/completions", json=_chat(max_tokens=0)), 422)
    _assert_openai_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 422)
    _assert_openai_error(client.post("/v1/completions", json={"model": MODEL}), 422)


def test_unknown_model_is_404(client: TestClient) -> None:
    err = _assert_openai_error(
        client.post("/v1/chat/completions", json={**_chat(), "model": "nope"}), 404, "model_not_found"
    )
    assert err["param"] == "model"


def test_context_window_checks_happen_before_any_node_is_called(client_with) -> None:  # noqa: ANN001
    # tokenize=always: with one node and no token limit the router would otherwise leave the prompt's
    # length to the engine (tests/security/test_templates.py pins that down).
    with client_with([_node("both-0", Role.BOTH, max_model_len=256)], tokenize="always") as client:
        _check_context_window(client)


def test_max_tokens_over_the_window_needs_no_tokenizer(client: TestClient) -> None:
    _assert_openai_error(
        client.post("/v1/chat/completions", json=_chat(max_tokens=256)), 400, "context_length_exceeded"
    )


def test_with_a_routing_choice_the_router_checks_the_window_itself(client_with) -> None:  # noqa: ANN001
    nodes = [_node("both-0", Role.BOTH, max_model_len=256), _node("both-1", Role.BOTH, max_model_len=256)]
    with client_with(nodes) as client:
        _check_context_window(client)


def _check_context_window(client: TestClient) -> None:
    _assert_openai_error(
        client.post("/v1/chat/completions", json=_chat(max_tokens=256)), 400, "context_length_exceeded"
    )
    long_prompt = "word " * 400  # > 256 tokens with the real tokenizer
    err = _assert_openai_error(
        client.post(
            "/v1/chat/completions", json={**_chat(max_tokens=8), "messages": [{"role": "user", "content": long_prompt}]}
        ),
        400,
        "context_length_exceeded",
    )
    assert "maximum context length is 256" in err["message"]
    _assert_openai_error(
        client.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt}), 400, "context_length_exceeded"
    )


def test_unsupported_options_are_400(client: TestClient) -> None:
    _assert_openai_error(client.post("/v1/chat/completions", json=_chat(n=2)), 400)
    _assert_openai_error(client.post("/v1/chat/completions", json=_chat(), headers={"x-tandem-route": "x"}), 400)


def test_unreachable_node_is_502_and_router_keeps_serving(client: TestClient) -> None:
    for stream in (False, True):
        err = _assert_openai_error(client.post("/v1/chat/completions", json=_chat(stream=stream)), 502)
        assert err["type"] == "upstream_error"
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    metrics = client.get("/metrics").text
    assert 'tandem_requests_total{model="tiny",status="error"} 2.0' in metrics
    assert 'tandem_errors_total{type="UpstreamError"} 2.0' in metrics


def test_with_every_decode_node_gone_a_prefill_node_serves_the_whole_request(client_with) -> None:  # noqa: ANN001
    # The prefill node's URL is a closed port: the 502 shows the request went to it, not a 503.
    with client_with([_node("p-0", Role.PREFILL)]) as c:
        resp = c.post("/v1/chat/completions", json=_chat())
        _assert_openai_error(resp, 502)
        assert "p-0" in resp.json()["error"]["message"] or "127.0.0.1:1" in resp.json()["error"]["message"]
        assert c.get("/health").status_code == 200


def test_failed_prefill_leg_falls_back_to_decode_node(client_with) -> None:  # noqa: ANN001
    # Both legs point at a dead port; the fallback must be attempted (counted) before the 502. P/D is
    # forced: cache_aware would prefill a prompt this short on the decode node (no prefill leg at all).
    with client_with([_node("p-0", Role.PREFILL), _node("d-0", Role.DECODE)]) as c:
        resp = c.post("/v1/chat/completions", json=_chat(), headers={"x-tandem-route": "disaggregated"})
        _assert_openai_error(resp, 502)
        assert "tandem_prefill_fallbacks_total 1.0" in c.get("/metrics").text


def test_cluster_view_lists_live_nodes(client_with) -> None:  # noqa: ANN001
    with client_with([_node("p-0", Role.PREFILL), _node("d-0", Role.DECODE)]) as c:
        data = c.get("/cluster").json()
        assert data["policy"] == "cache_aware"
        assert [(n["node_id"], n["role"]) for n in data["nodes"]] == [("d-0", "decode"), ("p-0", "prefill")]
        assert all(n["cached_blocks"] == 0 and n["router_inflight"] == 0 for n in data["nodes"])


def test_openapi_documents_the_generation_routes_with_their_request_models(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    model = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"model", "messages"} <= set(model["required"]) and "400" in chat["responses"]
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["required"]
