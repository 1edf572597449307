"""HTTP to the engines' OpenAI servers: one pooled client per router, errors translated at this edge.

Every token of every stream crosses this module, so it is built for per-chunk cost (issue 11):

- aiohttp, whose HTTP parser (llhttp, in C) decodes the chunked body; httpx parses it in Python
  (h11), about 10 µs per SSE event on this machine against about 1 µs.
- A stream is handed on as **batches of raw event payloads**: whatever one socket read brought, split
  at the SSE event boundaries, ``data: `` and the blank line removed, no JSON decoded. The relay
  (``router.sse``) decodes only the few fields it needs, forwards the bytes and writes one batch to
  the client in one send. Under load reads bring many events at once, so the per-event cost falls as
  the load rises.
- An in-band error event (``{"error": …}`` without choices) raises ``EngineRejected``; a stream that
  ends without ``[DONE]`` or breaks raises ``UpstreamError``.

Closing a stream early (client gone) closes the upstream connection, which is what makes vLLM abort
the request and free its KV blocks; a stream read to its end returns its connection to the pool.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec

from contracts.errors import EngineRejected, UpstreamError

_DONE = b"[DONE]"
_encode = msgspec.json.Encoder().encode


def _engine_error(resp_status: int, text: str) -> EngineRejected:
    message, param = text.strip() or f"engine answered {resp_status}", None
    try:
        data = json.loads(text)
        err = data.get("error", data) if isinstance(data, dict) else {}
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            param = err.get("param")
    except ValueError:
        pass
    return EngineRejected(resp_status, message, param=param)


def _stream_error(payload: bytes) -> EngineRejected | None:
    """An engine's in-band error event (``{"error": {...}}``, no choices), or None for a normal chunk.
    Only payloads that start like one are passed here."""
    chunk = json.loads(payload)
    if "choices" in chunk:
        return None
    err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
    code = err.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return EngineRejected(status, str(err.get("message", "engine stream error")))


class NodeClient:
    def __init__(self, *, connect_timeout_s: float, request_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use: an aiohttp session belongs to the running loop.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=60,
                                               enable_cleanup_closed=True),
                # sock_read bounds the wait for the next bytes: a whole non-streamed answer, or the
                # gap between two chunks of a stream.
                timeout=aiohttp.ClientTimeout(total=None, connect=self._connect_timeout_s,
                                              sock_read=self._request_timeout_s),
                auto_decompress=False, skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def post_json(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        try:
            async with self._client().post(url, data=_encode(body), headers=_json_headers(headers)) as resp:
                raw = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(f"node {url} unreachable: {type(exc).__name__}: {exc}") from exc
        if status >= 400:
            raise _engine_error(status, raw.decode(errors="replace"))
        try:
            return msgspec.json.decode(raw)  # type: ignore[no-any-return]
        except msgspec.DecodeError as exc:
            raise UpstreamError(f"node {url} answered non-JSON") from exc

    @asynccontextmanager
    async def open_stream(
        self, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> AsyncIterator[AsyncIterator[list[bytes]]]:
        """Open a streamed request; raises before yielding if the engine refuses it, so the caller can
        still answer with a proper HTTP status. Yields an iterator of event batches (see the module
        docstring); it ends after ``[DONE]``."""
        try:
            resp = await self._client().post(url, data=_encode(body), headers=_json_headers(headers))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(f"node {url} unreachable: {type(exc).__name__}: {exc}") from exc
        finished = False
        try:
            if resp.status >= 400:
                text = (await resp.read()).decode(errors="replace")
                raise _engine_error(resp.status, text)
            events = _events(resp, url)
            yield events
            finished = events.done  # type: ignore[attr-defined]
        finally:
            if finished:
                resp.release()  # read to its end: the connection goes back to the pool
            else:
                resp.close()  # mid-stream: closing the connection is what aborts the engine's request


def _json_headers(headers: dict[str, str]) -> dict[str, str]:
    return {"Content-Type": "application/json", **headers}


class _events:  # noqa: N801  (used like a generator function)
    """Async iterator of event batches from one SSE body; ``done`` once ``[DONE]`` and the end of the
    body were read."""

    __slots__ = ("_resp", "_url", "_reads", "_rest", "_saw_done", "done")

    def __init__(self, resp: aiohttp.ClientResponse, url: str) -> None:
        self._resp = resp
        self._url = url
        self._reads = resp.content.iter_any().__aiter__()
        self._rest = b""
        self._saw_done = False
        self.done = False

    def __aiter__(self) -> _events:
        return self

    async def __anext__(self) -> list[bytes]:
        while True:
            if self._saw_done:
                await self._drain()
                raise StopAsyncIteration
            try:
                block = await self._reads.__anext__()
            except StopAsyncIteration:
                raise UpstreamError(f"stream from {self._url} ended without [DONE]") from None
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise UpstreamError(f"stream from {self._url} broke: {type(exc).__name__}: {exc}") from exc
            batch = self._split(block)
            if batch:
                return batch

    async def _drain(self) -> None:
        """Read on to the end of the body (nothing but its last chunk follows ``[DONE]``): a response
        read to its end hands its connection back to the pool; one left unread is closed, and the
        next stream to this node pays for a new TCP connection."""
        if self.done:
            return
        try:
            async for _ in self._reads:
                pass
        except (TimeoutError, aiohttp.ClientError):
            return  # the answer is complete; only the connection is lost
        self.done = True

    def _split(self, block: bytes) -> list[bytes]:
        data = self._rest + block if self._rest else block
        # vLLM frames events with "\n\n"; SSE also allows "\r\n" line ends.
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        *events, self._rest = data.split(b"\n\n")
        batch: list[bytes] = []
        for event in events:
            # The common case, one "data: {...}" line, without the general loop (this runs per token).
            lines = (event,) if b"\n" not in event else event.split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue  # comments, other fields: not ours to forward
                payload = line[6:] if line.startswith(b"data: ") else line[5:].strip()
                if payload[:2] != b'{"':
                    payload = payload.strip()
                    if payload == _DONE:
                        self._saw_done = True
                        return batch
                if payload.startswith(b'{"error"'):
                    try:
                        err = _stream_error(payload)
                    except ValueError as exc:
                        raise UpstreamError(f"stream from {self._url} sent malformed data") from exc
                    if err is not None:
                        raise err
                batch.append(payload)
        return batch
