"""Streamed answers from the engines: HTTP/1.1 over pooled keep-alive connections, parsed as the bytes
arrive, and delivered to the relay without a task switch per chunk.

Why not aiohttp here (it still serves every non-streamed call, ``router.upstream.node_client``): every token of
the fleet crosses this path (issue 11), and in a pull client each chunk costs a future, a task wake-up
and a climb back up a stack of coroutines (reader, iterator, relay, response) before the bytes are
written on; its read timeout is also re-armed on every chunk. Measured over a paced stand-in engine
(`vllm bench serve` shape, 64 chunks a request), that machinery was most of the router's CPU per
request. Here the connection's ``data_received`` feeds httptools' C parser (the one uvicorn uses), the
body callback splits SSE events, and:

- **pull** (``async for batch in stream``): batches wait in a list and one future wakes the reader;
  used for the first batch (so a refusal or a dead node raises before the client sees a status line)
  and by tests;
- **push** (``attach(sink)``): later batches go straight from the parser callback to ``sink``, which
  writes them to the client (``router.edge.sse``). ``pause``/``resume`` stop reading the engine while the
  client's socket is full.

Per stream::

    POST ─▶ status + headers ─▶ (status >= 400: body read whole ─▶ EngineRejected)
                              └▶ events ─▶ batches ─▶ [DONE] ─▶ end of body ─▶ done (connection pooled)
    connection lost, no data for request_timeout_s, malformed HTTP, or no [DONE] ─▶ UpstreamError
    an in-band {"error": …} event ─▶ EngineRejected

``close()`` before ``done`` aborts the connection, which is what makes vLLM abort the request and free
its KV blocks. The idle timeout is checked by one timer per stream that re-arms itself only when it
fires, not on every chunk.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools

from contracts.errors import EngineRejected, TandemError, UpstreamError

_DONE = b"[DONE]"
Sink = Callable[[list[bytes]], None]


def engine_error(status: int, text: str) -> EngineRejected:
    """An engine's HTTP error answer as the router's exception (message and param kept)."""
    message, param = text.strip() or f"engine answered {status}", None
    try:
        data = json.loads(text)
        err = data.get("error", data) if isinstance(data, dict) else {}
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            param = err.get("param")
    except ValueError:
        pass
    return EngineRejected(status, message, param=param)


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


class SseStream:
    """The answer to one streamed request (see the module docstring)."""

    def __init__(self, url: str, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.url = url
        self._conn = conn
        self._loop = loop
        self.status = 0
        self.done = False
        """``[DONE]`` and the end of the body were read: the connection can serve another request."""
        self.got_bytes = False
        self._error: BaseException | None = None
        self._pending: list[bytes] = []
        self._rest = b""
        self._saw_done = False
        self._error_body: bytearray | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Sink | None = None

    # -- the reader's side ------------------------------------------------------------------------
    def __aiter__(self) -> SseStream:
        return self

    def take(self) -> list[bytes]:
        """What has arrived and not been taken yet (possibly nothing)."""
        batch, self._pending = self._pending, []
        return batch

    async def __anext__(self) -> list[bytes]:
        while True:
            if self._pending:
                return self.take()
            if self._error is not None:
                raise self._error
            if self.done:
                raise StopAsyncIteration
            await self._wait()

    async def head(self) -> None:
        """Wait for the status line and headers (and, for an error status, the whole body)."""
        while True:
            if self._error is not None:
                raise self._error
            if self.status and self._error_body is None:
                return
            await self._wait()

    async def first(self) -> None:
        """Wait until the first events are in, or the stream ended; raise if it failed before any."""
        while not self._pending and not self.done:
            if self._error is not None:
                raise self._error
            await self._wait()

    def attach(self, sink: Sink) -> None:
        """Switch to push: from now on the connection calls ``sink`` with each batch as it is parsed
        (``take`` what was already waiting first)."""
        assert not self._pending, "take() what is waiting before attaching"
        self._sink = sink

    def detach(self) -> None:
        self._sink = None

    async def finished(self) -> None:
        """Wait for the end of a pushed stream; raise its error."""
        while not self.done:
            if self._error is not None:
                raise self._error
            await self._wait()

    def pause(self) -> None:
        self._conn.pause_reading()

    def resume(self) -> None:
        self._conn.resume_reading()

    def fail(self, exc: BaseException) -> None:
        """End the stream with ``exc`` (also used by the relay when writing a pushed batch failed)."""
        if self._error is None and not self.done:
            self._error = exc
            self._conn.abort()
            self._wake()

    def close(self) -> None:
        """Done with it: a finished stream's connection goes back to the pool, any other is aborted."""
        self._sink = None
        if not self.done:
            self._conn.abort()

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the connection's side (parser callbacks) -------------------------------------------------
    def on_headers(self, status: int) -> None:
        self.status = status
        if status >= 400:
            self._error_body = bytearray()
        else:
            self._wake()

    def on_body(self, data: bytes) -> None:
        if self._error is not None:
            return  # failed (and aborted) while the parser was still working through a read
        if self._error_body is not None:
            self._error_body += data
            return
        try:
            batch = self._split(data)
        except TandemError as exc:
            self.fail(exc)
            return
        if not batch:
            return
        sink = self._sink
        if sink is None:
            self._pending += batch
            self._wake()
            return
        try:
            sink(batch)
        except BaseException as exc:  # the relay could not take it: end the stream with its error
            self.fail(exc)

    def on_complete(self) -> None:
        if self._error is not None:
            return
        if self._error_body is not None:
            text = self._error_body.decode(errors="replace")
            self._error_body = None
            self._error = engine_error(self.status, text)
        elif self._saw_done:
            self.done = True
        else:
            self._error = UpstreamError(f"stream from {self.url} ended without [DONE]")
        self._wake()

    def on_lost(self, reason: str) -> None:
        if self._error is None and not self.done:
            self._error = UpstreamError(f"stream from {self.url} broke: {reason}")
            self._wake()

    def _split(self, block: bytes) -> list[bytes]:
        """Event payloads in ``block`` (``data: `` and the blank line removed, not decoded)."""
        if (
            block[-2:] == b"\n\n"
            and block[:8] == b'data: {"'
            and not self._rest
            and block.count(b"\n") == 2
            and block[8:14] != b'error"'
            and not self._saw_done
        ):
            # What an engine sends per token: one read, one event, one line, a JSON object that is not
            # an error: its payload, without the general loop below (this runs once per token).
            return [block[6:-2]]
        data = self._rest + block if self._rest else block
        # vLLM frames events with "\n\n"; SSE also allows "\r\n" line ends.
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        *events, self._rest = data.split(b"\n\n")
        batch: list[bytes] = []
        if self._saw_done:
            return batch  # nothing but the end of the body follows [DONE]
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
                        raise UpstreamError(f"stream from {self.url} sent malformed data") from exc
                    if err is not None:
                        raise err
                batch.append(payload)
        return batch


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to an engine, serving one stream at a time."""

    def __init__(self, pool: StreamPool, key: tuple[str, int]) -> None:
        self._pool = pool
        self._key = key
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._stream: SseStream | None = None
        self.closed = False
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timeout_s = pool.request_timeout_s

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        stream = self._stream
        if stream is None:  # bytes nobody asked for: the connection is out of step, drop it
            self.abort()
            return
        stream.got_bytes = True
        self._last = self._pool.loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            stream.fail(UpstreamError(f"stream from {stream.url} broke: malformed HTTP ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self._pool.discard(self._key, self)  # an idle one the node closed (its keep-alive timeout)
        if self._stream is not None:
            self._stream.on_lost(f"{type(exc).__name__}: {exc}" if exc else "connection closed by the node")

    # -- httptools callbacks ----------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        if self._stream is not None:
            self._stream.on_headers(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self._stream is not None:
            self._stream.on_body(body)

    def on_message_complete(self) -> None:
        stream, self._stream = self._stream, None
        self._cancel_timer()
        if stream is None:
            return
        stream.on_complete()
        if stream.done and self._parser.should_keep_alive() and not self.closed:
            self._pool.put(self._key, self)
        else:
            self.abort()

    # -- used by the stream and the pool ----------------------------------------------------------
    def begin(self, stream: SseStream, request: bytes) -> None:
        assert self._transport is not None
        self._stream = stream
        self._last = self._pool.loop.time()
        self._timer = self._pool.loop.call_later(self._timeout_s, self._check_idle)
        self._transport.write(request)

    def _check_idle(self) -> None:
        stream = self._stream
        if stream is None:
            return
        idle = self._pool.loop.time() - self._last
        if idle >= self._timeout_s:
            stream.fail(UpstreamError(f"stream from {stream.url} broke: no data for {self._timeout_s:g} s"))
        else:
            self._timer = self._pool.loop.call_later(self._timeout_s - idle, self._check_idle)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def pause_reading(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.resume_reading()

    def abort(self) -> None:
        self._cancel_timer()
        if not self.closed:
            self.closed = True
            if self._transport is not None:
                self._transport.abort()


_TOKEN_SAFE = str.maketrans("", "", "\r\n")


def keep_alive(sock: Any, dead_after_s: float) -> None:
    """Make a connection to an engine fail within about ``dead_after_s`` once the engine's host stops
    answering at the TCP level (a partition: packets vanish, nothing is refused), instead of waiting out
    the read timeout. While the router waits for bytes, keepalive probes go out after a third of it and
    then every sixth; unanswered for the rest of it, the kernel resets the connection and the stream
    fails with a connection error (``connection_lost``), which ends the client's stream with an error
    event. ``TCP_USER_TIMEOUT`` bounds the same wait for data the router sent and the engine never
    acknowledged. Probes are answered by the engine host's kernel, not the engine, so a slow prefill
    or a stopped engine process keeps its connections. ``sock``: a socket or asyncio's wrapper of one;
    ``dead_after_s`` 0 leaves the socket as it is. Linux options; elsewhere only SO_KEEPALIVE is set."""
    if dead_after_s <= 0 or sock is None:
        return
    idle = max(1, int(dead_after_s / 3))
    interval = max(1, int(dead_after_s / 6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", max(1, math.ceil((dead_after_s - idle) / interval))),
        ("TCP_USER_TIMEOUT", int(dead_after_s * 1000)),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class StreamPool:
    """Keep-alive connections to the engines, for streamed requests. One per event loop."""

    MAX_IDLE_PER_NODE = 256

    def __init__(self, *, connect_timeout_s: float, request_timeout_s: float, dead_after_s: float = 0.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.dead_after_s = dead_after_s
        self.loop = asyncio.get_running_loop()
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}

    def put(self, key: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.MAX_IDLE_PER_NODE:
            idle.append(conn)
        else:
            conn.abort()

    def discard(self, key: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.get(key)
        if idle and conn in idle:
            idle.remove(conn)

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self, key: tuple[str, int], url: str) -> _Connection:
        try:
            transport, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self, key), key[0], key[1]), self.connect_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"node {url} unreachable: {type(exc).__name__}: {exc}") from exc
        keep_alive(transport.get_extra_info("socket"), self.dead_after_s)
        return conn

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamError(f"node url {url} is not http://host:port/…")
            port = parts.port or 80
            head = (
                f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.hostname}:{port}\r\n"
                "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            ).encode()
            target = self._targets[url] = ((parts.hostname, port), head)
        return target

    async def open(self, url: str, body: bytes, headers: dict[str, Any]) -> SseStream:
        """Send the request and wait for the answer's head; raises ``UpstreamError`` (unreachable,
        broken) or ``EngineRejected`` (an error status, with the engine's message)."""
        key, head = self._target(url)
        extra = "".join(f"{k}: {str(v).translate(_TOKEN_SAFE)}\r\n" for k, v in headers.items())
        request = b"".join((head, extra.encode(), b"Content-Length: %d\r\n\r\n" % len(body), body))
        conn = self._take(key)
        while True:
            fresh = conn is None
            if conn is None:
                conn = await self._connect(key, url)
            stream = SseStream(url, conn, self.loop)
            conn.begin(stream, request)
            try:
                await stream.head()
            except UpstreamError:
                stream.close()
                if not fresh and not stream.got_bytes:
                    conn = None  # a pooled connection the node had closed meanwhile: once more, anew
                    continue
                raise
            except BaseException:
                stream.close()
                raise
            return stream

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
