"""NodeClient against a real HTTP/1.1 server on loopback (a few lines of asyncio, so the test controls
the wire): streamed answers are split into event payloads (bytes, undecoded), in-band errors raise,
and a stream read to its end hands its connection back to the pool instead of costing a new TCP
connection per request."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from contracts.errors import EngineRejected, UpstreamError
from router.upstream.node_client import NodeClient


class SseServer:
    """Answers every POST with a chunked SSE body; counts accepted connections."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.all_closed = asyncio.Event()

    def drop_idle(self) -> None:
        """Close every connection, as a server does when its keep-alive timeout expires."""
        for w in self.writers:
            w.close()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/completions"

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        self.all_closed.clear()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                for event in self.events:
                    data = f"data: {event}\n\n".encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
        finally:
            self.writers.remove(writer)
            if not self.writers:
                self.all_closed.set()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def _read_all(client: NodeClient, url: str) -> list[dict]:
    async with client.open_stream(url, {"prompt": "x"}, {}) as batches:
        return [json.loads(payload) async for batch in batches for payload in batch]


async def test_streams_are_parsed_and_reuse_one_connection() -> None:
    server = SseServer([json.dumps({"choices": [{"text": "a"}]}), json.dumps({"choices": [{"text": "b"}]}), "[DONE]"])
    url = await server.start()
    client = NodeClient(connect_timeout_s=5, request_timeout_s=10)
    try:
        for _ in range(3):
            chunks = await _read_all(client, url)
            assert [c["choices"][0]["text"] for c in chunks] == ["a", "b"]
        assert server.connections == 1
    finally:
        await client.aclose()
        await server.close()


async def test_a_stream_without_done_is_an_upstream_error() -> None:
    server = SseServer([json.dumps({"choices": [{"text": "a"}]})])
    url = await server.start()
    client = NodeClient(connect_timeout_s=5, request_timeout_s=10)
    try:
        with pytest.raises(UpstreamError, match="without \\[DONE\\]"):
            await _read_all(client, url)
    finally:
        await client.aclose()
        await server.close()


async def test_an_in_band_error_event_raises_the_engines_status() -> None:
    server = SseServer(
        [
            json.dumps({"choices": [{"text": "a"}]}),
            json.dumps({"error": {"message": "bad things", "type": "BadRequestError", "code": 400}}),
            "[DONE]",
        ]
    )
    url = await server.start()
    client = NodeClient(connect_timeout_s=5, request_timeout_s=10)
    try:
        with pytest.raises(EngineRejected, match="bad things") as info:
            await _read_all(client, url)
        assert info.value.status_code == 400
    finally:
        await client.aclose()
        await server.close()


async def test_events_split_across_reads_and_crlf_framing_are_reassembled() -> None:
    """An event cut in two by TCP, and events framed with CRLF: the payloads come out whole."""
    events = [json.dumps({"choices": [{"text": f"t{i}"}]}) for i in range(50)]

    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        body = b"".join(f"data: {e}\r\n\r\n".encode() for e in events) + b"data: [DONE]\n\n"
        for i in range(0, len(body), 37):  # HTTP chunks that cut events anywhere
            piece = body[i : i + 37]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(conn, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    client = NodeClient(connect_timeout_s=5, request_timeout_s=10)
    try:
        chunks = await _read_all(client, url)
        assert [c["choices"][0]["text"] for c in chunks] == [f"t{i}" for i in range(50)]
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_a_pooled_connection_the_node_closed_is_replaced_without_an_error() -> None:
    """The node drops idle keep-alive connections (vLLM's server after 5 s): the next stream opens a
    new connection instead of failing on the dead one."""
    server = SseServer([json.dumps({"choices": [{"text": "a"}]}), "[DONE]"])
    url = await server.start()
    client = NodeClient(connect_timeout_s=5, request_timeout_s=10)
    try:
        assert [c["choices"][0]["text"] for c in await _read_all(client, url)] == ["a"]
        server.drop_idle()
        await asyncio.wait_for(server.all_closed.wait(), 5)
        assert [c["choices"][0]["text"] for c in await _read_all(client, url)] == ["a"]
        assert server.connections == 2
    finally:
        await client.aclose()
        await server.close()


def _keepalive(sock: socket.socket) -> tuple[int, ...]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
    )


async def test_engine_connections_give_up_on_a_silent_host_within_dead_after() -> None:
    """Streams and plain calls alike: keepalive probes after 5 s, every 2 s, 5 of them, and a 15 s user
    timeout, so a partitioned engine host fails its requests in about 15 s, not request_timeout_s (the
    partition itself: tests/lab/hosts/test_pd_hosts.py)."""
    server = SseServer([json.dumps({"choices": [{"text": "a"}]}), "[DONE]"])
    url = await server.start()
    client = NodeClient(connect_timeout_s=5, request_timeout_s=600, dead_after_s=15)
    try:
        await _read_all(client, url)
        assert client._streams is not None
        (pooled,) = [c for conns in client._streams._idle.values() for c in conns]
        assert pooled._transport is not None
        assert _keepalive(pooled._transport.get_extra_info("socket")) == (1, 5, 2, 5, 15_000)
        plain = client._socket((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", 0)))
        assert _keepalive(plain) == (1, 5, 2, 5, 15_000)
        plain.close()
        off = NodeClient(connect_timeout_s=5, request_timeout_s=600)  # 0: the kernel's defaults
        plain = off._socket((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", 0)))
        assert _keepalive(plain)[0] == 0 and _keepalive(plain)[4] == 0
        plain.close()
    finally:
        await client.aclose()
        await server.close()


class _NoConnection:
    """What an ``SseStream`` calls on its connection when it fails: nothing to do here."""

    def abort(self) -> None:
        pass


def _split_reads(reads: list[bytes]) -> tuple[list[bytes], BaseException | None]:
    from router.upstream.sse_upstream import SseStream

    stream = SseStream("http://engine", _NoConnection(), asyncio.new_event_loop())  # type: ignore[arg-type]
    payloads: list[bytes] = []
    try:
        for block in reads:
            payloads += stream._split(block)
    except EngineRejected as exc:
        return payloads, exc
    return payloads, None


@pytest.mark.parametrize(
    "events",
    [
        [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n', b"data: [DONE]\n\n"],
        # after [DONE] nothing more is an event, even one that looks like a token
        [b'data: {"choices":[]}\n\n', b"data: [DONE]\n\n", b'data: {"choices":[{"text":"late"}]}\n\n'],
        # an error event, alone in its read, is still an error
        [b'data: {"choices":[]}\n\n', b'data: {"error":{"message":"bad","code":400}}\n\n'],
        # comments, other fields, two-line events, CRLF framing, no space after the colon
        [b": keep-alive\n\n", b'event: x\ndata: {"choices":[]}\n\n', b'data: {"a":1}\r\n\r\n', b'data:{"b":2}\n\n'],
    ],
)
def test_an_event_per_read_splits_as_the_whole_body_in_one_read(events: list[bytes]) -> None:
    """The per-token fast path (one event in one read) gives what the general loop gives."""
    one_by_one = _split_reads(events)
    whole = _split_reads([b"".join(events)])
    assert repr(one_by_one[1]) == repr(whole[1])
    if whole[1] is None:  # (an error ends the stream: what came before it in the same read is moot)
        assert one_by_one[0] == whole[0]
