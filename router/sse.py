"""Relaying the decode node's stream to the client as OpenAI SSE.

Chunks keep the engine's shape with the router's response id; the usage chunk is forwarded only when
the client asked for it (the router always asks the engine, for its own accounting); ``[DONE]`` ends a
good stream; a failure after the status line is reported in-band as an ``error`` event, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio

from infra.errors import TandemError
from router.openai_errors import error_from_exception
from router.orchestrator import RequestTrace, record_usage


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _has_token(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if delta is not None:
        return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))
    return bool(choice.get("text"))


OnFinish = Callable[[str, TandemError | None], None]
"""Called once when the stream ends: (status, error)."""


async def relay(chunks: AsyncIterator[dict[str, Any]], stack: AsyncExitStack, trace: RequestTrace,
                include_usage: bool, on_finish: OnFinish) -> AsyncIterator[bytes]:
    status, error = "ok", None
    try:
        async for chunk in chunks:
            chunk["id"] = trace.request_id
            choices = chunk.get("choices") or []
            if chunk.get("usage") and not choices:
                record_usage(trace, chunk["usage"])
                if not include_usage:
                    continue
            for choice in choices:
                trace.finish_reason = choice.get("finish_reason") or trace.finish_reason
                trace.content.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
                for call in (choice.get("delta") or {}).get("tool_calls") or []:
                    trace.add_tool_call_delta(call)
            if any(_has_token(c) for c in choices):
                now = time.time()
                trace.first_token = trace.first_token or now
                trace.token_times.append(now)
            if not include_usage:
                chunk.pop("usage", None)
            yield sse_event(chunk)
        yield b"data: [DONE]\n\n"
    except TandemError as exc:
        status, error = "error", exc
        yield sse_event(error_from_exception(exc))
    except (asyncio.CancelledError, GeneratorExit):
        status = "cancelled"
        raise
    finally:
        # Shielded: under cancellation every await would raise again, and the upstream stream must be
        # closed for the engine to abort the request and free its blocks.
        with anyio.CancelScope(shield=True):
            await stack.aclose()
        trace.finish = time.time()
        on_finish(status, error)
