"""The router's HTTP server: uvicorn, without a periodic wake-up of its own.

uvicorn wakes its event loop ten times a second to look for a shutdown request and, every tenth time,
to refresh the ``Date`` header. On an idle router those wake-ups were most of its CPU (about 2 ms a
second, measured with ``/proc``), taken from the engines on a shared host and counted in every
request's share (``tandem bench overhead``). Here the main loop sleeps until a shutdown signal wakes
it, and the Date header is refreshed once a second as a job of the app's housekeeping loop
(``router.housekeeping``, ``Services.housekeeping``), in the wake-up the fleet refresh needs anyway.
An app without one gets a tick of its own, once a second, as often as the header changes.

The heap built at startup (every imported module, the FastAPI app, the tokenizers, pyarrow: about half
a million objects the cyclic collector tracks) is frozen once the server is up (``freeze_startup_heap``):
CPython's full collection walks every tracked object, and on this heap one took 200-300 ms of CPU,
the CPU of about a hundred streamed requests. It came every few hundred requests after start-up, so a
benchmark window of 64 requests either held one (router CPU per request 5-14 ms) or none (2-3 ms),
measured with ``tandem bench overhead`` and a gc callback. Frozen objects are never walked again; they
are what lives as long as the process anyway, and a collection just before the freeze leaves no garbage
among them. The young generations, where a request's objects live and die, are collected as before.

Proxy headers are off: the router is a client's first hop (it binds loopback by default), and
trusting ``X-Forwarded-For`` from any local process would let one spoof its address.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from router.edge.services import RouterApp
from router.housekeeping import Housekeeping
from telemetry.priority import CpuPriority, apply_cpu_priority

log = logging.getLogger("tandem.router")


class RouterServer(uvicorn.Server):
    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    def __init__(self, config: uvicorn.Config, housekeeping: Callable[[], Housekeeping | None] = lambda: None) -> None:
        super().__init__(config)
        self.housekeeping = housekeeping
        """The app's loop, asked for once the app has started (it opens with the app's services)."""

    async def main_loop(self) -> None:
        # uvicorn calls this once the app's startup is done (tokenizers warm, pyarrow loaded): the
        # heap is as large as it will be for good, and no request has run yet.
        log.info("startup heap frozen: %d objects out of the collector's full passes", freeze_startup_heap())
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        should_exit = await self.on_tick(0)  # counter % 10 == 0: on_tick refreshes the Date header
        housekeeping = self.housekeeping()
        if housekeeping is not None:
            housekeeping.every(housekeeping.tick_s, self._refresh_date, name="date-header")
            while not should_exit:
                await self._wake.wait()
                self._wake.clear()
                should_exit = await self.on_tick(1)  # only the exit checks
            return
        while not should_exit:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            should_exit = await self.on_tick(0)

    async def _refresh_date(self) -> None:
        if await self.on_tick(0) and self._wake is not None:
            self._wake.set()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # A signal handler: only the thread-safe call may touch the loop from here.
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)


def freeze_startup_heap() -> int:
    """Collect once, then move every object the cyclic collector tracks into its permanent generation,
    which no later collection walks (see the module docstring); the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port) that other processes of this user may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def serve(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str,
    reuse_port: bool = False,
    cpu_priority: CpuPriority = CpuPriority.NORMAL,
    keep_alive_s: int = 120,
) -> None:
    """Run ``app`` until SIGINT or SIGTERM; with ``reuse_port``, on a port shared with other replicas.
    ``cpu_priority`` is applied to this process first (``telemetry.priority``): the threads started
    later (the telemetry flusher, uvloop's workers) inherit it."""
    log.info("CPU priority: %s", apply_cpu_priority(cpu_priority))
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        proxy_headers=False,
        timeout_keep_alive=keep_alive_s,
        # A socket's messages are token events of a few hundred bytes: compressing each (client and
        # router alike) cost the engines' cores more than it saves on a local link (bench agents: the
        # socket arm's ITL 7 ms over SSE's with it on).
        ws_per_message_deflate=False,
    )

    def housekeeping() -> Housekeeping | None:
        return app.services.housekeeping if isinstance(app, RouterApp) else None

    RouterServer(config, housekeeping).run(sockets=[shared_socket(host, port)] if reuse_port else None)
