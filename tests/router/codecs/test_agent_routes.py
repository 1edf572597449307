"""The Responses and Messages routes on the real router (uvicorn, the exchange, the relay) over stand-in
engines: the SDKs read the streams, chains resolve, errors come in each API's shape, a client that
leaves mid-stream cancels the engine's stream as on chat."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai

from contracts.registry import Role
from tests.router.admission.support import wait_until
from tests.support.standin_cluster import metric, standin_cluster


async def test_responses_stream_chain_and_store(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 4}) as c:
        sdk = openai.AsyncOpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)
        stream = await sdk.responses.create(model=c.model, input="hello", max_output_tokens=8, stream=True)
        kinds, text, final = [], [], None
        async for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                text.append(ev.delta)
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-1] in ("response.completed", "response.incomplete") and final is not None and text
        assert final.output_text == "".join(text) and final.usage.input_tokens > 0
        await wait_until(lambda: _stored(sdk, final.id))
        second = await sdk.responses.create(model=c.model, input="again", previous_response_id=final.id)
        assert second.status in ("completed", "incomplete") and second.previous_response_id == final.id
        items = await sdk.responses.input_items.list(second.id)
        texts = [part.text for i in items.data if i.type == "message" for part in i.content]
        assert "hello" in texts and "again" in texts and "".join(text) in texts
        assert (await sdk.responses.cancel(final.id)).id == final.id
        await sdk.responses.delete(final.id)
        try:
            await sdk.responses.retrieve(final.id)
            raise AssertionError("a deleted response was found")
        except openai.NotFoundError:
            pass
        # Another tenant's (here: an unknown) previous_response_id is a 404 in OpenAI's shape.
        try:
            await sdk.responses.create(model=c.model, input="x", previous_response_id="resp_nope")
            raise AssertionError("an unknown previous_response_id was taken")
        except openai.NotFoundError as exc:
            assert exc.body["param"] == "previous_response_id"  # type: ignore[index]


async def _stored(sdk: openai.AsyncOpenAI, response_id: str) -> bool:
    try:
        await sdk.responses.retrieve(response_id)
        return True
    except openai.NotFoundError:
        return False


async def test_messages_stream_and_errors(tmp_path) -> None:
    router = {"max_body_bytes": 100_000}
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 4}, router=router) as c:
        sdk = anthropic.AsyncAnthropic(base_url=c.url, api_key="unused", max_retries=0)
        async with sdk.messages.stream(
            model=c.model, max_tokens=8, system="be brief", messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
        whole = await sdk.messages.create(model=c.model, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert whole.content[0].text and whole.id.startswith("msg_")
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            unknown = await client.post(
                "/v1/messages?beta=true",
                json={"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
            )
            assert unknown.status_code == 404
            assert unknown.json()["type"] == "error" and unknown.json()["error"]["type"] == "not_found_error"
            bad = await client.post("/v1/messages", json={"model": c.model, "messages": []})
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
            image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
            vision = await client.post(
                "/v1/messages",
                json={"model": c.model, "max_tokens": 5, "messages": [{"role": "user", "content": [image]}]},
            )
            assert vision.status_code == 400 and vision.json()["type"] == "error"
            big = await client.post("/v1/messages", content=b"x" * 100_001)
            assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
            resp = await client.post("/v1/responses", json={"model": "nope", "input": "x"})
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


async def test_a_client_gone_mid_stream_cancels_on_both_apis(tmp_path) -> None:
    engine = {"stream_tokens": 2000, "token_interval_s": 0.02}
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine=engine) as c:
        standin = c.engines["n"]
        bodies = {
            "/v1/responses": {"model": c.model, "input": "leave", "stream": True, "max_output_tokens": 2000},
            "/v1/messages": {
                "model": c.model,
                "stream": True,
                "max_tokens": 2000,
                "messages": [{"role": "user", "content": "leave"}],
            },
        }
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            for n, (path, body) in enumerate(bodies.items(), 1):
                async with httpx.AsyncClient(base_url=c.url, timeout=30) as leaving:
                    async with leaving.stream("POST", path, json=body) as resp:
                        assert resp.status_code == 200
                        events = 0
                        async for line in resp.aiter_lines():
                            events += line.startswith("data: ")
                            if events == 6:
                                break
                        assert standin.streams_open == 1
                await wait_until(lambda: standin.streams_open == 0)

                async def cancelled(n: int = n) -> bool:
                    text = (await client.get("/metrics")).text
                    return (metric(text, "tandem_requests_total", model=c.model, status="cancelled") or 0) >= n

                await wait_until(cancelled)


async def test_a_client_that_leaves_once_it_has_the_whole_answer_is_answered(tmp_path) -> None:
    # Codex CLI closes the stream on response.completed, which comes with the engine's usage chunk,
    # before the engine's [DONE] ends the upstream stream (here 3 s later). That request was answered:
    # recorded ok and stored for previous_response_id, not cancelled. The same for Messages' message_stop.
    # (The stand-in ends on its token budget: response.incomplete, Responses' other answered end.)
    engine = {"stream_tokens": 4, "done_delay_s": 3.0}
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine=engine) as c:
        sdk = openai.AsyncOpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)
        bodies = {
            "/v1/responses": {"model": c.model, "input": "hi", "stream": True},
            "/v1/messages": {
                "model": c.model,
                "stream": True,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
            },
        }
        ends = {"response.completed", "response.incomplete", "message_stop"}
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            response_id = None
            for n, (path, body) in enumerate(bodies.items(), 1):
                async with httpx.AsyncClient(base_url=c.url, timeout=30) as leaving:
                    async with leaving.stream("POST", path, json=body) as resp:
                        assert resp.status_code == 200
                        async for line in resp.aiter_lines():
                            event = json.loads(line[6:]) if line.startswith("data: ") else {}
                            if event.get("type") in ends:
                                response_id = response_id or (event.get("response") or {}).get("id")
                                break
                        else:
                            raise AssertionError(f"{path}: the stream ended without its answered end")
                        assert c.engines["n"].streams_open == 1  # left before the engine's [DONE]

                async def answered(n: int = n) -> bool:
                    text = (await client.get("/metrics")).text
                    return (metric(text, "tandem_requests_total", model=c.model, status="ok") or 0) >= n

                await wait_until(answered)
                text = (await client.get("/metrics")).text
                assert not metric(text, "tandem_requests_total", model=c.model, status="cancelled")
        assert response_id is not None
        await wait_until(lambda: _stored(sdk, response_id))
