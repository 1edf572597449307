"""What the router's OpenAPI document calls valid is what the engine takes, and what it calls invalid
the router refuses itself (issue 35: schemathesis against a fresh ``tandem up`` with a real engine,
``tests/security/test_cluster_fuzz.py``, found bodies the router accepted and passed on, which vLLM
then refused with a 400: a schema-valid request rejected). One test per finding, against a real router
(uvicorn, real Redis) over a stand-in engine, which records what reached it: a chat message whose
content is neither text nor parts, an empty completion prompt, ``stream_options`` on a plain answer, a
``tool_choice`` that no given tool satisfies (Responses and Messages), an empty stop sequence (Messages).
``top_p`` of 0 (vLLM takes (0, 1]) is in the document only: the engine's own 400 answers it."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.security.support import router

CHAT = "/v1/chat/completions"


async def test_chat_content_is_text_or_parts_and_null_only_for_the_assistant(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        assert r.engine is not None
        refused = [
            [{"role": "tool", "content": 0}],
            [{"role": "user", "content": None}],
            [{"role": "user", "content": {"text": "x"}}],
            [{"role": "user", "content": [{"text": "x"}]}],  # a part without a type
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            [{"role": "user", "content": [7]}],
            [{"role": "tool", "content": [{"type": "AAA", "text": ""}]}],
            [{"role": "assistant", "content": ["x"]}],  # vLLM takes a bare string part from a user only
        ]
        for messages in refused:
            resp = await client.post(CHAT, json={"model": r.model, "messages": messages, "max_tokens": 4})
            assert resp.status_code in (400, 422), (messages, resp.text)
        assert r.engine.bodies() == []  # none reached the engine
        served = [
            [{"role": "user", "content": "x"}],
            [{"role": "user", "content": [{"type": "text", "text": "y"}]}],
            [{"role": "user"}],  # no content at all: the engine takes it (an empty turn)
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}],
        ]
        for messages in served:
            resp = await client.post(CHAT, json={"model": r.model, "messages": messages, "max_tokens": 4})
            assert resp.status_code == 200, (messages, resp.text)
        doc = (await client.get("/openapi.json")).json()
        message = doc["components"]["schemas"]["Message"]
        roles = [branch["properties"]["role"]["enum"] for branch in message["anyOf"]]
        assert ["assistant"] in roles and all("assistant" not in rs for rs in roles if rs != ["assistant"])


async def test_an_empty_completion_prompt_is_refused_by_the_router(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        assert r.engine is not None
        for prompt in ("", [], [""], [[]]):
            resp = await client.post("/v1/completions", json={"model": r.model, "prompt": prompt, "max_tokens": 4})
            assert resp.status_code in (400, 422), (prompt, resp.text)
        assert r.engine.bodies("/v1/completions") == []
        ok = await client.post("/v1/completions", json={"model": r.model, "prompt": [1, 2], "max_tokens": 4})
        assert ok.status_code == 200, ok.text


async def test_stream_options_reach_the_engine_only_with_a_stream(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        assert r.engine is not None
        resp = await client.post(CHAT, json=r.chat(stream=False, stream_options={"include_usage": True}))
        assert resp.status_code == 200, resp.text
        assert "stream_options" not in r.engine.bodies()[-1]
        async with client.stream("POST", CHAT, json=r.chat(stream=True, stream_options={"include_usage": True})) as s:
            assert s.status_code == 200
            await s.aread()
        assert r.engine.bodies()[-1]["stream_options"]["include_usage"] is True


async def test_a_tool_choice_no_given_tool_satisfies_is_the_routers_400(tmp_path: Path) -> None:
    tool_r = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    tool_m = {"name": "lookup", "input_schema": {"type": "object"}}
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        assert r.engine is not None

        def responses(**kw: object) -> dict:
            return {"model": r.model, "input": "hi", "max_output_tokens": 4, **kw}

        def messages(**kw: object) -> dict:
            return {"model": r.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **kw}

        refused = [
            ("/v1/responses", responses(tools=[], tool_choice={"type": "function", "name": "x"})),
            ("/v1/responses", responses(tool_choice="required")),
            ("/v1/responses", responses(tools=[tool_r], tool_choice={"type": "function", "name": "other"})),
            ("/v1/messages", messages(tools=[], tool_choice={"type": "any"})),
            ("/v1/messages", messages(tools=[tool_m], tool_choice={"type": "tool", "name": "other"})),
        ]
        for path, body in refused:
            resp = await client.post(path, json=body)
            assert resp.status_code == 400, (path, body, resp.text)
            assert "tool_choice" in resp.text
        assert r.engine.bodies() == []
        # Asking nothing of no tools is served, and the engine is not told (vLLM refuses a tool_choice
        # without tools, even "auto").
        for path, body in [
            ("/v1/responses", responses(tools=[], tool_choice="auto")),
            ("/v1/messages", messages(tool_choice={"type": "none"})),
            ("/v1/responses", responses(tools=[tool_r], tool_choice={"type": "function", "name": "lookup"})),
        ]:
            resp = await client.post(path, json=body)
            assert resp.status_code == 200, (path, body, resp.text)
        sent = r.engine.bodies()
        assert "tool_choice" not in sent[0] and "tool_choice" not in sent[1]
        assert sent[2]["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}


async def test_an_empty_stop_sequence_or_more_than_four_are_the_routers_400(tmp_path: Path) -> None:
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        assert r.engine is not None
        body = {"model": r.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        resp = await client.post("/v1/messages", json={**body, "stop_sequences": [""]})
        assert resp.status_code == 400 and "stop_sequences" in resp.text, resp.text
        assert r.engine.bodies() == []
        resp = await client.post("/v1/messages", json={**body, "stop_sequences": ["\n\n"]})
        assert resp.status_code == 200, resp.text
        assert r.engine.bodies()[-1]["stop"] == ["\n\n"]
        # vLLM takes at most 4 stop strings: five are the router's 400 (and the document's maxItems).
        resp = await client.post("/v1/messages", json={**body, "stop_sequences": ["a", "b", "c", "d", "e"]})
        assert resp.status_code == 400 and "stop_sequences" in resp.text and "too long" in resp.text, resp.text
        assert len(r.engine.bodies()) == 1


async def test_a_tool_schema_with_integers_past_64_bits_reaches_the_engine_as_floats(tmp_path: Path) -> None:
    """vLLM answered a forced tool call (``tool_choice: any``) whose tool schema held an integer past 64
    bits with a bare 500 (the schema rides in the engine core's msgpack-encoded sampling parameters)."""
    huge = -111097189728935816147763200
    schema = {"type": "object", "x-bound": huge, "properties": {"n": {"type": "integer", "maximum": 2**70}}}
    async with router(tmp_path) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        assert r.engine is not None
        for path, body in [
            (
                "/v1/messages",
                {
                    "model": r.model,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"name": "t", "input_schema": schema}],
                    "tool_choice": {"type": "any"},
                },
            ),
            (
                "/v1/responses",
                {
                    "model": r.model,
                    "input": "hi",
                    "max_output_tokens": 4,
                    "tools": [{"type": "function", "name": "t", "parameters": schema}],
                    "tool_choice": "required",
                },
            ),
        ]:
            resp = await client.post(path, json=body)
            assert resp.status_code == 200, (path, resp.text)
            sent = r.engine.bodies()[-1]["tools"][0]["function"]["parameters"]
            assert sent["x-bound"] == float(huge) and isinstance(sent["x-bound"], float)
            assert sent["properties"]["n"]["maximum"] == float(2**70)
            assert sent["type"] == "object"
