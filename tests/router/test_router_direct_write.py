"""Body chunks written straight to uvicorn's transport: the same bytes as through ASGI, and the ASGI
path (with its back-pressure) whenever the client is not reading. Real router under uvicorn, stand-in
engines, real sockets."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from contracts.registry import Role
from router.edge.direct_write import DirectWriter, direct_writer
from tests.router.admission.support import wait_until
from tests.support.standin_cluster import metric, standin_cluster

CHAT = "/v1/chat/completions"


@pytest.fixture
def direct_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the chunks the relay wrote directly (the router runs in a thread of this process)."""
    sizes: list[int] = []
    lock = threading.Lock()
    real = DirectWriter.write

    def counting(self: DirectWriter, data: bytes) -> bool:
        wrote = real(self, data)
        if wrote:
            with lock:
                sizes.append(len(data))
        return wrote

    monkeypatch.setattr(DirectWriter, "write", counting)
    return sizes


async def test_a_stream_under_uvicorn_is_written_directly_and_arrives_whole(tmp_path, direct_writes) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, engine={"stream_tokens": 40}) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            r = await client.post(CHAT, json=c.chat("hi", stream=True, max_tokens=40))
    assert r.status_code == 200 and r.headers["transfer-encoding"] == "chunked"
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert sum('"content":" tok"' in e for e in events) == 40  # every token, in order, nothing doubled
    assert direct_writes, "no chunk took the direct path under uvicorn"


def test_no_direct_writer_without_uvicorns_httptools_cycle() -> None:
    class Cycle:  # the right attributes, the wrong server
        flow = transport = object()
        disconnected = response_complete = False
        chunked_encoding = response_started = True

        async def send(self, message: dict) -> None: ...

    assert direct_writer({}) is None
    assert direct_writer({"tandem.raw_send": Cycle().send}) is None


async def test_a_client_that_stops_reading_gets_the_asgi_path_and_is_cut_at_the_send_timeout(tmp_path) -> None:
    """Writes pile up in the kernel, then in uvicorn's transport, which pauses writing: from then on
    chunks go through ASGI send, which waits for the client; past the send timeout the stream is cut,
    the engine's stream ends and the node slot is free."""
    engine = {"stream_tokens": 1_000_000, "burst": 2000}
    router = {"client_send_timeout_s": 1.0}
    cluster = standin_cluster(tmp_path, {"n": Role.BOTH}, engine=engine, router=router, max_model_len=2_000_000)
    async with cluster as c:
        standin = c.engines["n"]
        host, port = c.url.removeprefix("http://").split(":")
        body = httpx.Request("POST", c.url + CHAT, json=c.chat("flood", stream=True, max_tokens=1_000_000))
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body.content)}\r\n\r\n"
        ).encode()
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            sock.sendall(head + body.content)
            await wait_until(lambda: standin.streams_open == 1, within_s=30)
            # Never read: the router must give up on this client by itself.
            await wait_until(lambda: standin.streams_open == 0, within_s=30)
            async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
                node = c.node_ids["n"]
                slots = metric((await client.get("/metrics")).text, "tandem_admission_slots_in_use", node=node)
                assert slots == 0
                assert (await client.post(CHAT, json=c.chat("next"))).status_code == 200
        finally:
            sock.close()
