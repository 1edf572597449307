"""A STAND-IN for an engine's OpenAI server: it is not an engine and never runs a model.

It exists so that the router can be measured and tested on its own: the admission benchmark's
"no-op engine" (router requests/s without any inference cost) and router unit tests that must hold
node slots or see exactly which messages reached a node. Everything that claims to test serving uses
real vLLM engines (``tests/e2e``), never this.

What it does
    ``POST /v1/chat/completions`` and ``/v1/completions``, streamed (SSE, ending ``[DONE]``) or not:
    records the body, optionally waits while its gate is closed (``close_gate`` / ``open_gate``), and
    answers at once with a fixed reply (``reply(body)`` decides: text, or a tool call). A request that
    carries ``kv_transfer_params`` with ``do_remote_decode`` is a prefill leg: it gets one token and
    ``kv_transfer_params`` back, as a prefill node answers (or, with ``prefill_error`` set, that HTTP
    status and an OpenAI-format error, as an engine that refused or failed it). Usage counts words, not
    tokens.

    Token streaming (``stream_tokens=N``): a streamed chat answer is instead ``max_tokens`` (at most N,
    N when unset) content chunks of one "token" each, byte for byte in vLLM's chunk shape
    (``model_dump_json(exclude_unset=True)``, compact, the id the ``X-Request-Id`` header asked for),
    then the finish chunk and, if asked, the usage chunk: what a router relays from a decode node,
    produced as cheaply as possible so that the router, not this stand-in, is what a relay benchmark
    measures. ``burst`` chunks go out per write.

    python -m bench.standin_engine --port 8901      # a separate process (the benchmark does this)
    python -m bench.standin_engine --port 8901 --stream-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

STANDIN_LABEL = "stand-in engine (no model, fixed reply; not an engine)"

Reply = Callable[[dict[str, Any]], dict[str, Any]]
"""Request body → the assistant message to answer with (``{"content": ...}`` or ``{"tool_calls": [...]}``)."""


def fixed_reply(text: str = "stand-in reply") -> Reply:
    return lambda body: {"role": "assistant", "content": text}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class StandInEngine:
    """A stand-in engine's state and its ASGI app. Thread-safe to inspect from the test's thread."""

    reply: Reply = field(default_factory=fixed_reply)
    stream_tokens: int | None = None
    """Token streaming mode (see the module docstring): at most this many one-token chunks per answer."""
    burst: int = 1
    """Token streaming mode: chunks per write."""
    token_interval_s: float = 0.0
    """Token streaming mode: pause between writes (an engine's time per output token); 0: none."""
    done_delay_s: float = 0.0
    """Token streaming mode: pause between the last chunk (finish and usage) and ``[DONE]``; 0: one write."""
    prefill_error: int | None = None
    """Prefill legs are answered with this HTTP status and an error (None: answered as a prefill node)."""
    received: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """(path, body) of every request, in arrival order."""
    traceparents: list[str | None] = field(default_factory=list)
    """The W3C ``traceparent`` header of every request (None: none sent), in the order of ``received``."""
    _open: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0
    streams_open: int = 0
    """Token streams being written now: one whose client (the router) went away ends and leaves this."""

    def __post_init__(self) -> None:
        self._open.set()
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._handle, methods=["POST"]),
                Route("/v1/completions", self._handle, methods=["POST"]),
                Route("/health", lambda _: Response("ok"), methods=["GET"]),
            ]
        )

    def close_gate(self) -> None:
        """From now on, requests wait (after being recorded) until ``open_gate``."""
        self._open.clear()

    def open_gate(self) -> None:
        self._open.set()

    def bodies(self, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        with self._lock:
            return [b for p, b in self.received if p == path]

    async def _handle(self, request: Request) -> Response:
        body = await request.json()
        path = request.url.path
        header_id = request.headers.get("x-request-id")
        with self._lock:
            self.received.append((path, body))
            self.traceparents.append(request.headers.get("traceparent"))
            self.in_flight += 1
        try:
            # Polled: the gate is opened from the test's thread, and a waiting thread per held request
            # could outlive a failed test.
            while not self._open.is_set():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            return self._answer(path, body, header_id)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _answer(self, path: str, body: dict[str, Any], header_id: str | None = None) -> Response:
        chat = path.endswith("chat/completions")
        rid = f"standin-{uuid.uuid4().hex[:12]}"
        prompt_words = len(json.dumps(body.get("messages") or body.get("prompt") or "").split())
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode") and self.prefill_error is not None:
            error = {"message": "stand-in prefill failed", "type": "InternalServerError", "param": None}
            return JSONResponse({"error": {**error, "code": self.prefill_error}}, status_code=self.prefill_error)
        if params.get("do_remote_decode"):  # prefill leg
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion" if chat else "text_completion",
                    "model": body.get("model"),
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "length",
                            **({"message": {"role": "assistant", "content": "x"}} if chat else {"text": "x"}),
                        }
                    ],
                    "usage": {"prompt_tokens": prompt_words, "completion_tokens": 1, "total_tokens": prompt_words + 1},
                    "kv_transfer_params": {"stand_in": True, "remote_request_id": rid},
                }
            )
        if self.stream_tokens and chat and body.get("stream"):
            return self._token_stream(body, header_id or rid)
        message = self.reply(body)
        text = message.get("content") or ""
        calls = message.get("tool_calls") or []
        finish = "tool_calls" if calls else "stop"
        completion_words = max(1, len(text.split()))
        usage = {
            "prompt_tokens": prompt_words,
            "completion_tokens": completion_words,
            "total_tokens": prompt_words + completion_words,
        }
        if not body.get("stream"):
            choice = {"message": message} if chat else {"text": text}
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": body.get("model"),
                    "choices": [{"index": 0, "finish_reason": finish, **choice}],
                    "usage": usage,
                }
            )

        def chunk(choice: dict[str, Any] | None, **extra: Any) -> bytes:
            payload = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [choice] if choice else [],
                **extra,
            }
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        async def events() -> AsyncIterator[bytes]:
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
                if calls:
                    deltas = [{"index": i, **c} for i, c in enumerate(calls)]
                    yield chunk({"index": 0, "delta": {"tool_calls": deltas}, "finish_reason": None})
                if text:
                    yield chunk({"index": 0, "delta": {"content": text}, "finish_reason": None})
                yield chunk({"index": 0, "delta": {}, "finish_reason": finish})
            else:
                yield chunk({"index": 0, "text": text, "finish_reason": None})
                yield chunk({"index": 0, "text": "", "finish_reason": finish})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield chunk(None, usage=usage)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _token_stream(self, body: dict[str, Any], rid: str) -> Response:
        assert self.stream_tokens
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.stream_tokens
        n = max(1, min(int(asked), self.stream_tokens))
        rid = f"chatcmpl-{rid}"
        head = (
            f'data: {{"id":"{rid}","object":"chat.completion.chunk","created":{int(time.time())},'
            f'"model":{json.dumps(body.get("model"))},"choices":[{{"index":0,'
        ).encode()
        first = head + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
        token = head + b'"delta":{"content":" tok"},"logprobs":null,"finish_reason":null}]}\n\n'
        last = head + b'"delta":{},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
        prompt_words = len(json.dumps(body.get("messages") or "").split())
        usage = b""
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = (
                head[: head.index(b'"choices"')]
                + (
                    f'"choices":[],"usage":{{"prompt_tokens":{prompt_words},"total_tokens":{prompt_words + n},'
                    f'"completion_tokens":{n}}}}}\n\n'
                ).encode()
            )
        burst, interval, done_delay = self.burst, self.token_interval_s, self.done_delay_s

        async def events() -> AsyncIterator[bytes]:
            with self._lock:
                self.streams_open += 1
            try:
                yield first
                left = n
                while left > 0:
                    if interval:
                        await asyncio.sleep(interval)  # paced like an engine's decode steps
                    k = min(burst, left)
                    yield token * k
                    left -= k
                if done_delay:
                    yield last + usage
                    await asyncio.sleep(done_delay)
                    yield b"data: [DONE]\n\n"
                else:
                    yield last + usage + b"data: [DONE]\n\n"
            finally:
                with self._lock:
                    self.streams_open -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


class ServerThread:
    """Serve an ASGI app with uvicorn on 127.0.0.1 in a daemon thread (lifespan included).

    with ServerThread(app) as url: ...
    """

    def __init__(self, app: Any, port: int = 0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False, lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        end = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)  # uvicorn offers no start notification across threads
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a stand-in engine (NOT an engine: fixed replies).")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--stream-tokens",
        type=int,
        default=None,
        help="token streaming mode: streamed chat answers are max_tokens one-token chunks (at most N)",
    )
    parser.add_argument("--burst", type=int, default=1, help="token streaming mode: chunks per write")
    parser.add_argument(
        "--token-interval-ms",
        type=float,
        default=0.0,
        help="token streaming mode: pause between writes, like an engine's time per output token",
    )
    args = parser.parse_args()
    engine = StandInEngine(
        stream_tokens=args.stream_tokens, burst=args.burst, token_interval_s=args.token_interval_ms / 1000
    )
    uvicorn.run(engine.app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
