"""Per-request records reach the Parquet lake through `tandem up`'s lake writer: exactly one row per
request with its fields filled, the tool call, the feedback; and telemetry never blocks serving."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from fastapi.testclient import TestClient

from router.edge.app import create_app
from router.settings import RouterSettings
from telemetry import query
from tests.e2e.conftest import LiveCluster, wait_for

pytestmark = pytest.mark.e2e

TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


def _rows(cluster: LiveCluster, sql: str) -> list[dict]:
    try:
        return query(cluster.lake, sql).to_pylist()
    except Exception:  # noqa: BLE001 - the table's first file may not exist yet while we poll
        return []


def test_every_request_lands_once_with_tool_call_and_feedback(cluster: LiveCluster) -> None:
    session = f"lake-{uuid.uuid4().hex}"
    # Forced onto the P/D path: under cache_aware (the default) prompts this short prefill on the decode
    # node, and this test checks the prefill-leg fields of the records.
    h = {"x-session-id": session, "x-tandem-route": "disaggregated"}
    chat = {
        "model": cluster.model,
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    with httpx.Client(base_url=cluster.url, timeout=120, headers=h) as c:
        first = c.post("/v1/chat/completions", json=chat).json()
        streamed = c.post("/v1/chat/completions", json={**chat, "stream": True}).text
        assert streamed.rstrip().endswith("data: [DONE]")
        completion = {"model": cluster.model, "prompt": "1, 2, 3,", "max_tokens": 6}
        c.post("/v1/completions", json=completion).raise_for_status()
        tool = c.post(
            "/v1/chat/completions",
            json={
                **chat,
                "max_tokens": 40,
                "tools": [TOOL],
                "messages": [{"role": "user", "content": "Open the README."}],
                "tool_choice": {"type": "function", "function": {"name": "read_file"}},
            },
        ).json()
        calls = tool["choices"][0]["message"]["tool_calls"]
        assert calls and calls[0]["function"]["name"] == "read_file"
        assert c.post("/v1/feedback", json={"response_id": "chatcmpl-unknown", "rating": 1}).status_code == 404
        fb = c.post(
            "/v1/feedback",
            json={"response_id": first["id"], "rating": -1, "comment": "too short", "labels": ["quality"]},
        )
        assert fb.status_code == 202, fb.text

    sql = f"SELECT * FROM requests WHERE session_id = '{session}'"
    assert wait_for(lambda: len(_rows(cluster, sql)) >= 4, timeout_s=30), "request rows did not reach the lake"
    rows = _rows(cluster, sql)
    assert len(rows) == 4 and len({r["event_id"] for r in rows}) == 4
    for r in rows:
        assert r["status"] == "ok" and r["http_status"] == 200
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        assert r["prompt_tokens"] > 0 and r["completion_tokens"] > 0
        assert r["decode_node"] and r["routing_policy"] == "cache_aware" and r["routing_decision"] == "pd"
        assert r["prefill_node"] and r["kv_connector"] == "tandem"
        assert r["t_arrival"] <= r["t_routed"] <= r["t_prefill_start"] <= r["t_prefill_end"] <= r["t_finish"]
        # the KV transfer: the decode engine's report (non-streamed) or the prefill node's (streamed)
        assert r["transfer_bytes"] > 0 and r["transfer_s"] >= 0, (r["stream"], r["transfer_bytes"])
        # a layer-wise pull (the router's default) starts while the prefill computes, a whole one after it
        assert r["t_prefill_start"] <= r["t_transfer_start"] <= r["t_transfer_end"] <= r["t_finish"]
    assert {r["endpoint"] for r in rows} == {"chat", "completions"}
    assert sorted(r["stream"] for r in rows) == [False, False, False, True]
    assert [r["num_tool_calls"] for r in rows if r["request_id"] == tool["id"]] == [1]

    tool_sql = f"SELECT * FROM tool_calls WHERE session_id = '{session}'"
    assert wait_for(lambda: len(_rows(cluster, tool_sql)) == 1, timeout_s=30)
    [call] = _rows(cluster, tool_sql)
    assert call["tool_name"] == "read_file" and call["request_id"] == tool["id"]
    assert call["tool_call_id"] == calls[0]["id"] and call["arguments_valid_json"]

    # KV cache activity: the engines' KV events, aggregated per node and interval by the router. The
    # chats above are shorter than one 128-token block (no block stored): store a few blocks here, so
    # the test does not depend on what other tests left in the lake.
    since = time.time()
    with httpx.Client(base_url=cluster.url, timeout=120) as c:
        c.post(
            "/v1/completions", json={"model": cluster.model, "prompt": f"{session} " + "lake " * 400, "max_tokens": 1}
        ).raise_for_status()
    kv_sql = f"SELECT * FROM kv_events WHERE blocks_stored > 0 AND interval_end >= to_timestamp({since})"
    assert wait_for(lambda: len(_rows(cluster, kv_sql)) >= 1, timeout_s=40), "no kv_events rows"
    assert {r["role"] for r in _rows(cluster, kv_sql)} & {"prefill", "decode"}

    fb_sql = f"SELECT * FROM feedback WHERE session_id = '{session}'"
    assert wait_for(lambda: len(_rows(cluster, fb_sql)) == 1, timeout_s=30)
    [row] = _rows(cluster, fb_sql)
    assert (row["response_id"], row["rating"], row["comment"], list(row["labels"])) == (
        first["id"],
        -1,
        "too short",
        ["quality"],
    )


def test_requests_stream_normally_when_telemetry_redis_is_down(cluster: LiveCluster) -> None:
    # A second router over the same live nodes whose telemetry Redis does not exist.
    settings = RouterSettings(redis_url=cluster.redis_url, telemetry_redis_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(settings)) as c:
        for _ in range(3):
            with c.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": cluster.model,
                    "stream": True,
                    "max_tokens": 5,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": "Say hi."}],
                },
            ) as resp:
                assert resp.status_code == 200
                body = "".join(resp.iter_text())
            assert body.rstrip().endswith("data: [DONE]") and '"content"' in body

        def dropped() -> float:
            total = 0.0
            for line in c.get("/metrics").text.splitlines():
                if line.startswith("tandem_telemetry_dropped_events_total{") and 'table="requests"' in line:
                    total += float(line.rsplit(" ", 1)[1])
            return total

        assert wait_for(lambda: dropped() >= 3, timeout_s=20), "drops not counted"
