"""HTTP to the engines' OpenAI servers: one pooled client per router, errors translated at this edge.

Streams are parsed from SSE into chunk dicts; closing a stream early (client gone) closes the upstream
connection, which is what makes vLLM abort the request and free its KV blocks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from infra.errors import EngineRejected, UpstreamError


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


class NodeClient:
    def __init__(self, *, connect_timeout_s: float, request_timeout_s: float) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def post_json(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        try:
            resp = await self._client.post(url, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"node {url} unreachable: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400:
            raise _engine_error(resp.status_code, resp.text)
        try:
            return resp.json()
        except ValueError as exc:
            raise UpstreamError(f"node {url} answered non-JSON") from exc

    @asynccontextmanager
    async def open_stream(
        self, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Open a streamed request; raises before yielding if the engine refuses it, so the caller can
        still answer with a proper HTTP status. Yields an iterator of chunk dicts (``[DONE]`` ends it)."""
        try:
            cm = self._client.stream("POST", url, json=body, headers=headers)
            resp = await cm.__aenter__()
        except httpx.HTTPError as exc:
            raise UpstreamError(f"node {url} unreachable: {type(exc).__name__}: {exc}") from exc
        try:
            if resp.status_code >= 400:
                text = (await resp.aread()).decode(errors="replace")
                raise _engine_error(resp.status_code, text)
            yield _chunks(resp, url)
        finally:
            await cm.__aexit__(None, None, None)


async def _chunks(resp: httpx.Response, url: str) -> AsyncIterator[dict[str, Any]]:
    done = False
    try:
        async for line in resp.aiter_lines():
            if done or not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                # Read on to the end of the body (nothing but its last chunk follows): a response read
                # to its end hands its connection back to the pool; one left unread is closed, and the
                # next stream to this node pays for a new TCP connection.
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk and "choices" not in chunk:
                err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                code = err.get("code")
                status = code if isinstance(code, int) and 400 <= code < 600 else 500
                raise EngineRejected(status, str(err.get("message", "engine stream error")))
            yield chunk
    except httpx.HTTPError as exc:
        raise UpstreamError(f"stream from {url} broke: {type(exc).__name__}: {exc}") from exc
    except ValueError as exc:
        raise UpstreamError(f"stream from {url} sent malformed data") from exc
    if not done:
        raise UpstreamError(f"stream from {url} ended without [DONE]")
