"""A client that stops reading its stream is cut after the send timeout: the node slot it held goes
back and the router keeps serving others. Real router (uvicorn, loopback) over a STAND-IN engine that
streams more than every buffer between them holds."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from contracts.registry import Role
from tests.support.standin_cluster import metric, standin_cluster

TOKENS = 60_000
"""About 9 MB of chunks: more than the router's socket send buffer (4 MB at most here) and the
client's 4 KB receive buffer together."""


def _slots(url: str, node_id: str) -> float:
    page = httpx.get(f"{url}/metrics", timeout=10).text
    return metric(page, "tandem_admission_slots_in_use", node=node_id) or 0.0


async def _until(check, timeout_s: float) -> bool:  # noqa: ANN001
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if await asyncio.to_thread(check):
            return True
        await asyncio.sleep(0.1)  # polling the router's metrics page: nothing to wait on
    return False


@pytest.mark.parametrize(
    "pace_s",
    [
        0.0,  # the engine's answer is all read before buffers fill: the final write is what waits
        0.002,  # paced: the client's buffers fill mid-stream, and reading from the engine pauses
    ],
)
async def test_a_client_that_stops_reading_is_cut_and_its_slot_returned(tmp_path: Path, pace_s: float) -> None:
    async with standin_cluster(
        tmp_path,
        {"both": Role.BOTH},
        engine={"stream_tokens": TOKENS, "burst": 64, "token_interval_s": pace_s},
        router={"client_send_timeout_s": 1.0},
        max_model_len=1 << 20,
    ) as c:
        node = c.node_ids["both"]
        host, port = c.url.removeprefix("http://").split(":")
        body = json.dumps(c.chat("never read", stream=True, max_tokens=TOKENS)).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        try:
            assert await _until(lambda: _slots(c.url, node) == 1.0, 30), "the stream never took its slot"
            started = time.monotonic()
            assert await _until(lambda: _slots(c.url, node) == 0.0, 30), "the stalled stream kept its slot"
            assert time.monotonic() - started < 20
            # The router goes on serving: another client's whole answer.
            async with httpx.AsyncClient(timeout=30) as client:
                resp = await client.post(f"{c.url}/v1/chat/completions", json=c.chat("hi", max_tokens=4))
                page = (await client.get(f"{c.url}/metrics")).text
            assert resp.status_code == 200
            assert metric(page, "tandem_errors_total", type="ClientStalled") == 1.0
        finally:
            sock.close()
