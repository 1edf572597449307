"""One streamed completion over real HTTP (SSE), timed as the client sees it.

``send`` posts ``/v1/completions`` with the prompt as token ids, ``stream: true`` and
``stream_options.include_usage``, and reads the event stream as bytes arrive. It records the time of
every chunk that carries a token (TTFT is the first; ITL the gaps between them, so a chunk holding
several tokens counts once, as a client sees it) and the final ``usage`` (prompt, completion and cached
tokens, ``prompt_tokens_details.cached_tokens``). A token's chunk may hold no text: a special token
(``<|im_end|>`` after an ignored EOS) or the first bytes of a character are held back by the
detokenizer, and vLLM still sends the chunk (text ``""``, no ``finish_reason``). Such chunks count; a
closing chunk with no text and a ``finish_reason`` counts only when no chunk came before it (a one-token
answer whose token has no text), since a server may close a stream with one after the last token.
``ignore_eos`` asks a vLLM engine for exactly ``max_tokens`` tokens, so output lengths are the trace's.

Outcomes (``Outcome.status``): ``ok`` (the stream ended with ``[DONE]``), ``error`` (an HTTP error
status, a transport error, an ``error`` event, a stream cut before ``[DONE]``: ``error`` says which),
``cancelled`` (the trace's client left at ``cancel_after_s``: the replay closes the connection then).
Transport errors are results here, not exceptions: a replay measures failures, it does not stop on them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Outcome:
    status: str = "error"
    http_status: int | None = None
    error: str | None = None
    sent: float = 0.0
    """``time.monotonic()`` when the request was sent."""
    chunk_times: list[float] = field(default_factory=list)
    """Monotonic time of every chunk that carried a token (module docstring)."""
    end: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


def _usage(out: Outcome, usage: dict[str, Any]) -> None:
    out.prompt_tokens = usage.get("prompt_tokens")
    out.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    out.cached_tokens = details.get("cached_tokens")


def _carries_token(choices: list[dict[str, Any]], *, first: bool) -> bool:
    """Whether a completion chunk's choices hold a token (module docstring): text, or no text yet no
    ``finish_reason``, or a closing chunk with no chunk before it. A usage-only chunk has no choices."""
    for c in choices:
        if "text" not in c:
            continue
        if c["text"] or c.get("finish_reason") is None or first:
            return True
    return False


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    out: Outcome,
    on_chunk: Callable[[Outcome], None] | None,
) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        out.http_status = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            out.error = f"HTTP {resp.status_code}: {text[:300]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out.status = "ok"
                return
            try:
                event = json.loads(data)
            except ValueError:
                out.error = f"undecodable event: {data[:200]}"
                return
            if "error" in event:
                out.error = f"error event: {json.dumps(event['error'])[:300]}"
                return
            if _carries_token(event.get("choices") or [], first=not out.chunk_times):
                out.chunk_times.append(time.monotonic())
                if on_chunk is not None:
                    on_chunk(out)
            if event.get("usage"):
                _usage(out, event["usage"])
        out.error = "stream ended before [DONE]"


async def send(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    *,
    cancel_after_s: float | None = None,
    on_chunk: Callable[[Outcome], None] | None = None,
) -> Outcome:
    """``on_chunk``: called with the outcome so far each time a chunk with text arrives (a profile
    watches a batch of streams to send a prompt into it at a given token)."""
    out = Outcome(sent=time.monotonic())
    try:
        if cancel_after_s is None:
            await _stream(client, url, body, headers, out, on_chunk)
        else:
            try:
                await asyncio.wait_for(_stream(client, url, body, headers, out, on_chunk), timeout=cancel_after_s)
            except TimeoutError:
                out.status, out.error = "cancelled", f"client left after {cancel_after_s:.3f} s (as recorded)"
    except httpx.HTTPError as exc:
        out.status, out.error = "error", f"{type(exc).__name__}: {exc}"
    out.end = time.monotonic()
    return out
