"""Server-history mode through the real router app (uvicorn, real Redis, SQLite store) over a STAND-IN
engine that records what it was sent: with ``x-tandem-history: server`` the client sends only its new
messages, the engine sees the whole conversation, and the turn is recorded as usual."""

from __future__ import annotations

import httpx

from contracts.registry import Role
from tests.router.admission.support import wait_until
from tests.support.standin_cluster import standin_cluster

CHAT = "/v1/chat/completions"
SERVER = {"x-tandem-history": "server"}


async def _turns(client: httpx.AsyncClient, session: str) -> list[dict]:
    r = await client.get(f"/v1/sessions/{session}")
    return r.json()["turns"] if r.status_code == 200 else []


async def _wait_turns(client: httpx.AsyncClient, session: str, n: int) -> list[dict]:
    async def recorded() -> bool:
        return len(await _turns(client, session)) == n

    await wait_until(recorded)
    return await _turns(client, session)


def _echo(body: dict) -> dict:
    return {"role": "assistant", "content": f"reply to {body['messages'][-1]['content']}"}


async def test_second_turn_sends_only_the_new_message_and_the_engine_sees_it_all(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}) as c:
        engine = c.engines["n"]
        engine.reply = _echo
        system = {"role": "system", "content": "You are terse."}
        first = {"role": "user", "content": "first question"}
        second = {"role": "user", "content": "second question"}
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            # Turn 1 names no session: one is created and returned.
            r1 = await client.post(CHAT, json={**c.chat(""), "messages": [system, first]}, headers=SERVER)
            assert r1.status_code == 200, r1.text
            session = r1.headers["x-session-id"]
            assert engine.bodies()[-1]["messages"] == [system, first]
            await _wait_turns(client, session, 1)
            # Turn 2, streamed: only the new user message.
            r2 = await client.post(
                CHAT,
                json={**c.chat(""), "messages": [second], "stream": True},
                headers={**SERVER, "x-session-id": session},
            )
            assert r2.status_code == 200 and "reply to second question" in r2.text
            assert engine.bodies()[-1]["messages"] == [
                system,
                first,
                {"role": "assistant", "content": "reply to first question"},
                second,
            ]
            turns = await _wait_turns(client, session, 2)
            # Recorded as usual: each turn holds what it added, nothing twice.
            assert [t["messages"] for t in turns] == [[system, first], [second]]
            assert [t["response"]["content"] for t in turns] == ["reply to first question", "reply to second question"]
            # Client mode on the same session: the request is sent as it is, no history added.
            r3 = await client.post(CHAT, json=c.chat("alone"), headers={"x-session-id": session})
            assert r3.status_code == 200
            assert engine.bodies()[-1]["messages"] == [{"role": "user", "content": "alone"}]


async def test_tool_call_round_trip_with_server_history(tmp_path) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}

    def reply(body: dict) -> dict:
        if body["messages"][-1]["role"] == "user":
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"role": "assistant", "content": "a.py prints 1"}

    async with standin_cluster(tmp_path, {"n": Role.BOTH}) as c:
        engine = c.engines["n"]
        engine.reply = reply
        headers = {**SERVER, "x-session-id": "sess-tools"}
        ask = {"role": "user", "content": "What does a.py print?"}
        result = {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"}
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            r1 = await client.post(CHAT, json={**c.chat(""), "messages": [ask], "stream": True}, headers=headers)
            assert r1.status_code == 200 and "read_file" in r1.text
            await _wait_turns(client, "sess-tools", 1)
            r2 = await client.post(CHAT, json={**c.chat(""), "messages": [result]}, headers=headers)
            assert r2.status_code == 200
            assert r2.json()["choices"][0]["message"]["content"] == "a.py prints 1"
            assert engine.bodies()[-1]["messages"] == [ask, {"role": "assistant", "tool_calls": [call]}, result]
            turns = await _wait_turns(client, "sess-tools", 2)
            assert turns[1]["messages"] == [result]


async def test_history_headers_are_checked(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            r = await client.post("/v1/completions", json={"model": c.model, "prompt": "hi"}, headers=SERVER)
            assert r.status_code == 400 and r.json()["error"]["param"] == "x-tandem-history"
            for mode in ("both", "Server", ""):  # only the OpenAPI document's enum (schemathesis found these)
                r = await client.post(CHAT, json=c.chat("hi"), headers={"x-tandem-history": mode})
                assert r.status_code == 400 and r.json()["error"]["param"] == "x-tandem-history"
            r = await client.post(CHAT, json=c.chat("hi"), headers={**SERVER, "x-session-id": "no spaces"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "x-session-id"
            assert c.engines["n"].received == []
