"""The router's HTTP server: uvicorn, with a once-a-second housekeeping tick.

uvicorn wakes its event loop ten times a second to look for a shutdown request and, every tenth time,
to refresh the ``Date`` header. On an idle router those wake-ups were most of its CPU (about 2 ms a
second, measured with ``/proc``), taken from the engines on a shared host and counted in every
request's share (``tandem bench overhead``). Here the loop ticks once a second, which is as often as
the header changes, and a shutdown signal wakes it at once, so stopping is as quick as before.

Proxy headers are off: the router is a client's first hop (it binds loopback by default), and
trusting ``X-Forwarded-For`` from any local process would let one spoof its address.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from types import FrameType
from typing import Any

import uvicorn


class RouterServer(uvicorn.Server):
    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # on_tick refreshes the Date header when counter % 10 == 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # A signal handler: only the thread-safe call may touch the loop from here.
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port) that other processes of this user may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def serve(app: Any, *, host: str, port: int, log_level: str, reuse_port: bool = False) -> None:
    """Run ``app`` until SIGINT or SIGTERM; with ``reuse_port``, on a port shared with other replicas."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, proxy_headers=False)
    RouterServer(config).run(sockets=[shared_socket(host, port)] if reuse_port else None)
