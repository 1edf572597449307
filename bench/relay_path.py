"""The router's own Python per relayed chunk, in one process and without a socket: what a compiled relay
loop could at most take off each chunk.

    python -m bench.relay_path --chunks 20000

One engine chunk as vLLM frames it (HTTP/1.1 chunked, one ``data: {...}`` event) is fed to the upstream
connection's ``data_received`` (``router.upstream.sse_upstream``: httptools, the SSE split), pushed to
the chat relay (``router.edge.sse._Relay``: the typed view, the trace, the id check) and framed for the
client as ``router.edge.direct_write`` does, into a transport that only counts bytes. Everything but the
two syscalls (the read from the engine, the write to the client) and the event loop's wake-up between
them, warm in cache. ``tandem bench overhead`` and ``python -m bench.relay_cpu`` measure the whole chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

from router.edge.sse import _Relay
from router.record.trace import RequestTrace
from router.upstream.sse_upstream import SseStream, StreamPool, _Connection

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class _Counting:
    """A transport that keeps nothing but the byte count (both ends of the relay)."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self.bytes += len(data)

    def abort(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def engine_chunk(request_id: str, i: int) -> bytes:
    """Token ``i`` of a chat stream, as vLLM's server writes it on the wire."""
    event = (
        b'data: {"id":"%s","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
        b'"delta":{"content":" tok%d"},"logprobs":null,"finish_reason":null}]}\n\n' % (request_id.encode(), i)
    )
    return b"%x\r\n%s\r\n" % (len(event), event)


@dataclass(frozen=True)
class PathResult:
    chunks: int
    us_per_chunk: float
    client_bytes: int
    tokens_traced: int


async def relay_path(chunks: int) -> PathResult:
    """Relay ``chunks`` engine chunks through the router's code path; time per chunk and what came out."""
    pool = StreamPool(connect_timeout_s=5.0, request_timeout_s=600.0)
    conn = _Connection(pool, ("standin", 0))
    conn.connection_made(_Counting())  # type: ignore[arg-type]
    stream = SseStream("http://standin", conn, pool.loop)
    conn.begin(stream, b"")
    conn.data_received(_HEAD)
    trace = RequestTrace(request_id="chatcmpl-relay-path", kind="chat", model="m")
    relay = _Relay(trace, include_usage=False)
    client = _Counting()

    def sink(batch: list[bytes]) -> None:
        data = relay.batch(batch)
        client.write(b"%x\r\n%s\r\n" % (len(data), data))  # as router.edge.direct_write frames it

    stream.attach(sink)
    wire = [engine_chunk(trace.request_id, i % 1000) for i in range(chunks)]
    start = time.perf_counter()
    for data in wire:
        conn.data_received(data)
    elapsed = time.perf_counter() - start
    conn.abort()
    pool.close()
    return PathResult(chunks, elapsed / chunks * 1e6, client.bytes, len(trace.token_times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=20_000, help="chunks relayed (one stream)")
    args = ap.parse_args()
    res = asyncio.run(relay_path(args.chunks))
    print(f"router relay path: {res.us_per_chunk:.2f} µs per chunk over {res.chunks} chunks (no syscalls, warm)")


if __name__ == "__main__":
    main()
