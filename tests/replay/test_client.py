"""What ``replay.client.send`` counts as a token's chunk: TTFT and ITL in replays and profiles come from
these times, so a token whose text the detokenizer holds back (a special token after an ignored EOS,
the first bytes of a character) must still count, and a server's closing chunk must not add a token."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from replay.client import send


def _sse(*events: dict[str, Any]) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def _choice(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def _send(body: bytes) -> Any:
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    )

    async def go() -> Any:
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, "http://engine/v1/completions", {"prompt": [1, 2]}, {})

    return asyncio.run(go())


USAGE = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}


def test_tokens_without_text_count_as_chunks() -> None:
    """vLLM streams ``<|im_end|>`` (skipped as special) as a chunk with text "": tokens without text
    count, and the answer is ok (it was an error before: no chunk at all)."""
    out = _send(_sse(_choice(""), _choice(""), _choice("", "length"), USAGE))
    assert out.status == "ok"
    # the closing chunk holds vLLM's last token, but without text it cannot be told from a bare closing
    # chunk (below), so it counts only as a first token: the stream's last gap is the one not seen
    assert len(out.chunk_times) == 2
    assert out.completion_tokens == 3


def test_a_one_token_answer_without_text_has_a_first_token() -> None:
    out = _send(_sse(_choice("", "length"), USAGE))
    assert out.status == "ok" and len(out.chunk_times) == 1


def test_a_closing_chunk_after_text_is_not_another_token() -> None:
    """The stand-in engine (and some servers) close with an empty chunk carrying only the finish reason."""
    out = _send(_sse(_choice("Hello"), _choice(" world"), _choice("", "stop"), USAGE))
    assert len(out.chunk_times) == 2


def test_usage_only_chunks_and_text_with_finish_count_as_they_should() -> None:
    out = _send(_sse(_choice("a"), _choice("b", "length"), USAGE))
    assert out.status == "ok" and len(out.chunk_times) == 2
