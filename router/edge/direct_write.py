"""Streamed body chunks written straight to the client's connection, past the ASGI send chain.

Every token of the fleet crosses the router (issue 11), and through ASGI each one is a message dict
and a climb through three ``send`` coroutines (Starlette's error and exception middlewares, then
uvicorn's), each a frame, every chunk. When the server is uvicorn's httptools protocol, which frames a
streamed body as HTTP/1.1 chunks and has no buffer of its own between ``send`` and the socket, the
relay may write the same bytes to the same transport itself: ``<hex length>\\r\\n<data>\\r\\n``, what
uvicorn writes for ``{"type": "http.response.body", "body": data, "more_body": True}``.

Only the middle of a body goes this way. The response start and the body's end always go through
ASGI (uvicorn then finishes the response: the last chunk, keep-alive), and so does any chunk while
the client is not reading (uvicorn's flow control has paused writing: its ``send`` then waits for the
client, and the relay's back-pressure depends on that wait) or once the client has gone (``send``
then drops it). Under any other server, or a body uvicorn does not frame in chunks, there is no direct
writer and every chunk takes the ASGI path.

``RAW_SEND`` is the scope key under which the router's app (``router.edge.app.RouterApp``) keeps the
server's own ``send`` for the relay to find.
"""

from __future__ import annotations

from typing import Any

RAW_SEND = "tandem.raw_send"
_UVICORN_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"


class DirectWriter:
    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self._transport = cycle.transport

    def write(self, data: bytes) -> bool:
        """Write one chunk of the body now; False when it must go through ASGI ``send`` instead."""
        cycle = self._cycle
        if cycle.disconnected or cycle.response_complete or self._flow.write_paused:
            return False
        self._transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        return True


def direct_writer(scope: dict[str, Any]) -> DirectWriter | None:
    """The writer for a response whose start has been sent, or None when its server is not one this
    module knows to frame chunks as it does."""
    cycle = getattr(scope.get(RAW_SEND), "__self__", None)
    if cycle is None or type(cycle).__module__ != _UVICORN_HTTPTOOLS:
        return None
    if getattr(cycle, "chunked_encoding", None) is not True or not getattr(cycle, "response_started", False):
        return None
    if not all(hasattr(cycle, a) for a in ("flow", "transport", "disconnected", "response_complete")):
        return None
    return DirectWriter(cycle)
