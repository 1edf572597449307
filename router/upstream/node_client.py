"""HTTP to the engines' OpenAI servers: one client per router, errors translated at this edge.

- Streamed answers (every token of the fleet crosses them) go through ``router.upstream.sse_upstream``: pooled
  keep-alive connections, bytes parsed as they arrive, batches of raw event payloads handed to the
  relay without a task switch per chunk (see that module for why and for the measurements).
- Everything else (prefill legs, non-streamed answers) goes through aiohttp, whose HTTP parser is C.
- An in-band error event (``{"error": …}`` without choices) raises ``EngineRejected``; a stream that
  ends without ``[DONE]`` or breaks raises ``UpstreamError``.

Closing a stream early (client gone) closes the upstream connection, which is what makes vLLM abort
the request and free its KV blocks; a stream read to its end returns its connection to the pool.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec

from contracts.errors import EngineRejected, UpstreamError
from router.upstream.sse_upstream import SseStream, StreamPool, engine_error, keep_alive

_encode = msgspec.json.Encoder().encode

ENGINE_POOL_IDLE_S = 60
"""How long an idle connection to an engine stays in the pool. Engines keep theirs longer
(``NodeSettings.engine_keep_alive_s``): the side that reuses a connection must be the one that closes it."""


class NodeClient:
    def __init__(
        self,
        *,
        connect_timeout_s: float,
        request_timeout_s: float,
        dead_after_s: float = 0.0,
        auth_headers: dict[str, str] | None = None,
    ) -> None:
        self._auth = dict(auth_headers or {})
        """The engines' API key (``contracts.secret.engine_auth_headers``), sent on every call."""
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._dead_after_s = dead_after_s
        """Every engine connection's keepalive (``sse_upstream.keep_alive``; RouterSettings.upstream_dead_after_s)."""
        self._session: aiohttp.ClientSession | None = None
        self._streams: StreamPool | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use: an aiohttp session belongs to the running loop.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=1024,
                    limit_per_host=0,
                    keepalive_timeout=ENGINE_POOL_IDLE_S,
                    enable_cleanup_closed=True,
                    socket_factory=self._socket,
                ),
                # sock_read bounds the wait for a whole non-streamed answer.
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=self._connect_timeout_s, sock_read=self._request_timeout_s
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    def _socket(self, addr_info: tuple[Any, ...]) -> socket.socket:
        family, type_, proto = addr_info[:3]
        sock = socket.socket(family=family, type=type_, proto=proto)
        keep_alive(sock, self._dead_after_s)
        return sock

    async def aclose(self) -> None:
        if self._streams is not None:
            self._streams.close()
        if self._session is not None:
            await self._session.close()

    async def post_json(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        try:
            headers = _json_headers({**self._auth, **headers})
            async with self._client().post(url, data=_encode(body), headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(f"node {url} unreachable: {type(exc).__name__}: {exc}") from exc
        if status >= 400:
            raise _not_the_clients(url, engine_error(status, raw.decode(errors="replace")))
        try:
            return msgspec.json.decode(raw)  # type: ignore[no-any-return]
        except msgspec.DecodeError as exc:
            raise UpstreamError(f"node {url} answered non-JSON") from exc

    @asynccontextmanager
    async def open_stream(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> AsyncIterator[SseStream]:
        """Open a streamed request; raises before yielding if the engine refuses it, so the caller can
        still answer with a proper HTTP status. Yields the ``SseStream`` (pulled with ``async for``, or
        pushed with ``attach``); leaving the block closes it (aborting the engine's request unless the
        stream was read to its end)."""
        if self._streams is None:  # made on first use: it belongs to the running loop
            self._streams = StreamPool(
                connect_timeout_s=self._connect_timeout_s,
                request_timeout_s=self._request_timeout_s,
                dead_after_s=self._dead_after_s,
            )
        try:
            stream = await self._streams.open(url, _encode(body), {**self._auth, **headers})
        except EngineRejected as exc:
            raise _not_the_clients(url, exc) from exc
        try:
            yield stream
        finally:
            stream.close()


def _not_the_clients(url: str, exc: EngineRejected) -> EngineRejected:
    """An engine's 401 refuses the router's key, not the client's: a cluster-secret mismatch between
    router and node, answered as a 502 (another node may still serve), never as the client's 401."""
    if exc.status_code != 401:
        return exc
    return EngineRejected(
        502, f"engine {url} refused the router's API key: do the router and its node share the cluster secret?"
    )


def _json_headers(headers: dict[str, str]) -> dict[str, str]:
    return {"Content-Type": "application/json", **headers}
