"""A Redis that accepts connections and never answers (issue 35, item 5): every Redis client of the router
has a timeout, so the router keeps serving the models it knows (admission vouches for recent callers,
the fleet keeps its last view) and answers a model nobody serves with its 404 instead of waiting for a
registry read that never ends. The Redis is real, reached through a TCP relay the test switches to
swallow everything."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.security.support import router

CHAT = "/v1/chat/completions"
DEADLINE_S = 5.0
"""What a request may take while Redis is black-holed: a few 0.5 s timeouts and a loaded host."""


class Relay:
    """127.0.0.1:<port> → the real Redis; once ``blackhole`` is set, bytes in either direction are
    read and dropped, and new connections are accepted and never answered."""

    def __init__(self) -> None:
        self.blackhole = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._socks: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            self._socks.append(client)
            if self.blackhole.is_set():
                threading.Thread(target=self._pump, args=(client, None), daemon=True).start()
                continue
            upstream = socket.create_connection(("127.0.0.1", 6379))
            self._socks.append(upstream)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket | None) -> None:
        try:
            while data := src.recv(65536):
                if dst is not None and not self.blackhole.is_set():
                    dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in self._socks:
            s.close()


@pytest.fixture
def relay() -> Iterator[Relay]:
    r = Relay()
    yield r
    r.close()


async def test_a_blackholed_redis_leaves_the_router_serving(tmp_path: Path, relay: Relay) -> None:
    async with (
        router(
            tmp_path,
            redis_url=f"redis://127.0.0.1:{relay.port}/14",
            registry_refresh_s=1.0,
            admission_overrides={"redis_socket_timeout_s": 0.5, "redis_connect_timeout_s": 0.5},
        ) as r,
        httpx.AsyncClient(base_url=r.url, timeout=30) as client,
    ):
        assert (await client.post(CHAT, json=r.chat())).status_code == 200
        relay.blackhole.set()
        end = time.monotonic() + 4  # several registry refreshes into the black hole
        while time.monotonic() < end:
            t0 = time.monotonic()
            answer = await client.post(CHAT, json=r.chat())
            assert answer.status_code == 200, answer.text
            assert time.monotonic() - t0 < DEADLINE_S
        t0 = time.monotonic()
        unknown = await client.post(CHAT, json={**r.chat(), "model": "nobody-serves-this"})
        assert unknown.status_code == 404, unknown.text
        assert time.monotonic() - t0 < DEADLINE_S
        assert (await client.get("/health")).status_code == 200
