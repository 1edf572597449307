"""Keys, limits and session history through a router over live engines; a tool-call round trip with
the OpenAI SDK. The key tests run their own in-process router (own key namespace and store), so
turning auth on there leaves the shared cluster's router open for the other tests."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from router.admission.context import AdmissionContext, AdmissionSettings
from router.edge.app import create_app
from router.settings import RouterSettings
from tests.e2e.conftest import LiveCluster
from tests.support.helpers import wait_for

pytestmark = pytest.mark.e2e

TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


@pytest.fixture
def keyed_router(cluster: LiveCluster, tmp_path: Path):  # noqa: ANN201
    adm = AdmissionSettings(
        redis_url=cluster.redis_url, key_prefix=f"t{uuid.uuid4().hex[:8]}:", sqlite_path=tmp_path / "tandem.db"
    )

    async def make_key(tpm: int) -> str:
        ctx = await AdmissionContext.create(adm, start_writer=False)
        try:
            _, key = await ctx.keys.create_key("acme", rpm=100, tpm=tpm)
            return key
        finally:
            await ctx.close()

    key = asyncio.run(make_key(tpm=400))
    with TestClient(create_app(RouterSettings(redis_url=cluster.redis_url, admission=adm))) as client:
        yield client, key


def _chat(model: str, content: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, **kw}


def test_keys_limits_and_history(keyed_router, cluster: LiveCluster) -> None:  # noqa: ANN001
    client, key = keyed_router
    assert client.post("/v1/chat/completions", json=_chat(cluster.model, "hi")).status_code == 401
    bad = client.post(
        "/v1/chat/completions", json=_chat(cluster.model, "hi"), headers={"authorization": "Bearer tdm-not-a-key"}
    )
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"

    auth = {"authorization": f"Bearer {key}"}
    session = f"fruit-{uuid.uuid4().hex[:8]}"  # the agent names its session; nameless requests store none
    first = client.post(
        "/v1/chat/completions", json=_chat(cluster.model, "Name a fruit."), headers={**auth, "x-session-id": session}
    )
    assert first.status_code == 200, first.text
    assert first.headers["x-session-id"] == session
    answer = first.json()["choices"][0]["message"]["content"]
    follow = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And a vegetable?"},
    ]
    second = client.post(
        "/v1/chat/completions",
        headers={**auth, "x-session-id": session},
        json={"model": cluster.model, "messages": follow, "max_tokens": 8, "temperature": 0},
    )
    assert second.status_code == 200 and second.headers["x-session-id"] == session

    def turns() -> list:
        resp = client.get(f"/v1/sessions/{session}", headers=auth)
        return resp.json().get("turns", []) if resp.status_code == 200 else []

    assert wait_for(lambda: len(turns()) == 2, timeout_s=20), turns()
    t1, t2 = turns()
    assert [m["content"] for m in t1["messages"]] == ["Name a fruit."]
    assert t1["response"]["content"] == answer
    assert [m["content"] for m in t2["messages"]] == ["And a vegetable?"]  # only what was new

    # The tenant's 400 tokens/min: prompt + reserved completion tokens are charged up front.
    over = client.post("/v1/chat/completions", json=_chat(cluster.model, "word " * 150, max_tokens=300), headers=auth)
    assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1
    assert over.json()["error"]["code"] == "rate_limit_exceeded"


def test_tool_call_round_trip_with_the_sdk(cluster: LiveCluster) -> None:
    sdk = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
    messages = [{"role": "user", "content": "Open README.md and summarise it."}]
    stream = sdk.chat.completions.create(
        model=cluster.model,
        messages=messages,
        tools=[TOOL],
        max_tokens=40,
        temperature=0,
        stream=True,
        tool_choice={"type": "function", "function": {"name": "read_file"}},
    )
    call_id, name, args = "", "", ""
    for chunk in stream:
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call_id = delta_call.id or call_id
            name = (delta_call.function.name if delta_call.function else None) or name
            args += (delta_call.function.arguments if delta_call.function else None) or ""
    assert name == "read_file" and call_id
    assert "path" in json.loads(args)

    messages += [
        {
            "role": "assistant",
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "# Tandem\nP/D disaggregated serving on vLLM."},
    ]
    final = sdk.chat.completions.create(
        model=cluster.model, messages=messages, tools=[TOOL], max_tokens=24, temperature=0
    )
    assert final.choices[0].message.content
    assert not final.choices[0].message.tool_calls
