"""The router keeps a client's idle connection ``keep_alive_s`` (uvicorn's own 5 s would race clients'
pools, which keep theirs 5 s too), and engines keep the router's longer than its pool does: in both
hops the side that reuses a connection is the side that closes it."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from node_agent.node import engine_env
from node_agent.settings import NodeSettings
from router.settings import RouterSettings
from router.upstream.node_client import ENGINE_POOL_IDLE_S
from tests.router.test_router_cpu_priority import _router


def _idle_connection_closed_within(url: str, seconds: float) -> bool:
    """Send one keep-alive request, read its answer, then wait up to ``seconds`` for the server to
    close the idle connection (a blocking read that ends when it does)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=seconds) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: keep-alive\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(4096)
        assert data.startswith(b"HTTP/1.1 "), data[:100]  # any answer (no node: 503) keeps it alive
        try:
            while sock.recv(4096):  # the rest of the body, then the end of the stream
                pass
        except TimeoutError:
            return False
        return True


@pytest.mark.parametrize(("keep_alive_s", "closed_within_3s"), [(1, True), (30, False)])
def test_the_router_closes_an_idle_client_connection_after_keep_alive_s(
    tmp_path: Path, keep_alive_s: int, closed_within_3s: bool
) -> None:
    proc, url = _router(tmp_path, TANDEM_ROUTER_KEEP_ALIVE_S=str(keep_alive_s))
    try:
        started = time.monotonic()
        assert _idle_connection_closed_within(url, 3.0) is closed_within_3s
        if closed_within_3s:
            assert time.monotonic() - started >= 0.9  # not at once: it was kept about a second
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_defaults_keep_connections_longer_than_the_client_side_of_each_hop() -> None:
    assert RouterSettings().keep_alive_s > 5  # httpx's and the openai SDK's pool expiry
    node = NodeSettings()
    assert node.engine_keep_alive_s > ENGINE_POOL_IDLE_S
    assert engine_env(node)["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == str(node.engine_keep_alive_s)
