"""A decode engine killed under load (issue 12), on a real 1P+1D cluster started by `tandem up`:

* no stream hangs (every request ends: an answer, or an error, never 60 s without a byte);
* the node deregisters at once and its agent restarts the engine: it comes back under the same node id
  with a new epoch, without `tandem up` restarting anything;
* the router's KV index holds nothing of the old engine;
* the cluster serves again, and a SIGTERM to `tandem up` then leaves no process of it alive.

* every stream the dead engine was serving ends with an OpenAI-shaped error event, never a cut connection;
* a response in flight on a WebSocket (``GET /v1/responses`` upgraded) when the engine dies ends with
  ``response.failed``, and the next ``response.create`` on the same socket is answered;
* while no decode node is left, a request falls back to colocated serving on the prefill node.

Redis DB 13."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
import redis
import websockets

from contracts.registry import NodeInfo, node_key
from tests.e2e.test_cache_routing import SYSTEM
from tests.support.helpers import alive_pids, wait_for

pytestmark = pytest.mark.e2e

REDIS_URL = "redis://127.0.0.1:6379/13"
ROUTER_PORT = 18500
NODE_BASE = 18510
DECODE_ID = f"decode-1-{NODE_BASE + 10}"
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Load:
    """Streams from a few threads until stopped; records how every request ended."""

    url: str
    model: str
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def worker(self, n: int) -> None:
        timeout = httpx.Timeout(connect=10, read=60, write=10, pool=10)  # read: "no byte for 60 s" is a hang
        with httpx.Client(timeout=timeout) as client:
            i = 0
            while not self.stop.is_set():
                i += 1
                body = {
                    "model": self.model,
                    "stream": True,
                    "max_tokens": 24,
                    "temperature": 0,
                    "messages": [
                        {"role": "system", "content": SYSTEM},  # > 1 block: the index sees it
                        {"role": "user", "content": f"Worker {n} request {i}: count to ten."},
                    ],
                }
                outcome = "ok"
                try:
                    with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as resp:
                        if resp.status_code != 200:
                            outcome = f"status {resp.status_code}"
                        else:
                            text = "".join(resp.iter_text())
                            outcome = "ok" if "[DONE]" in text and '"error"' not in text else "error event"
                except httpx.TimeoutException:
                    outcome = "hung"
                except httpx.HTTPError as exc:
                    outcome = f"cut: {type(exc).__name__}"
                with self.lock:
                    self.outcomes.append(outcome)
                if outcome != "ok":
                    self.stop.wait(0.5)  # a client's retry pause, not synchronisation

    def count(self, what: str) -> int:
        with self.lock:
            return sum(1 for o in self.outcomes if o == what)


@dataclass
class SocketSession:
    """One WebSocket to ``/v1/responses`` in its own thread: a long response (the engine is killed while
    it streams), then, once told, one more on the same socket. ``ends`` holds each one's last event."""

    url: str
    model: str
    streaming: threading.Event = field(default_factory=threading.Event)
    again: threading.Event = field(default_factory=threading.Event)
    ends: list[str] = field(default_factory=list)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._session())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    async def _response(self, ws: websockets.ClientConnection, prompt: str, tokens: int) -> str:
        create = {"type": "response.create", "model": self.model, "input": prompt, "max_output_tokens": tokens}
        await ws.send(json.dumps({**create, "temperature": 0}))
        while True:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if ev["type"] == "response.output_text.delta":
                self.streaming.set()
            if ev["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                return str(ev["type"])

    async def _session(self) -> None:
        async with websockets.connect(self.url.replace("http://", "ws://") + "/v1/responses") as ws:
            self.ends.append(await self._response(ws, "Count from 1 to 1000, one number per line.", 1000))
            await asyncio.to_thread(self.again.wait, 300)
            self.ends.append(await self._response(ws, "Still there?", 4))


def _epoch(r: redis.Redis, node_id: str) -> int | None:
    raw = r.get(node_key(node_id))
    return None if raw is None else msgspec.msgpack.decode(raw, type=NodeInfo).epoch


def _cluster_view(url: str) -> dict[str, dict]:
    try:
        return {n["node_id"]: n for n in httpx.get(f"{url}/cluster", timeout=5).json()["nodes"]}
    except (httpx.HTTPError, ValueError):
        return {}


def test_a_killed_decode_engine_comes_back_with_a_new_epoch_and_nothing_stale(tmp_path: Path) -> None:
    r = redis.Redis.from_url(REDIS_URL)
    r.flushdb()
    url = f"http://127.0.0.1:{ROUTER_PORT}"
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem",
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--dtype",
            "float32",
            "--port",
            str(ROUTER_PORT),
            "--node-base-port",
            str(NODE_BASE),
            "--redis-url",
            REDIS_URL,
            "--workdir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TANDEM_NODE_HEARTBEAT_S": "0.5"},
    )
    lines: queue.Queue[str] = queue.Queue()
    assert up.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in iter(up.stdout.readline, "")], daemon=True).start()
    seen: list[str] = []
    pids: set[int] = set()
    load: Load | None = None
    threads: list[threading.Thread] = []
    try:
        deadline = time.monotonic() + 900
        while not any(s.startswith("READY ") for s in seen):
            try:
                seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(f"tandem up not ready:\n{''.join(seen[-40:])}")
        pids.update(p.pid for p in psutil.Process(up.pid).children(recursive=True))
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        first_epoch = _epoch(r, DECODE_ID)
        assert first_epoch is not None and first_epoch >= 1

        load = Load(url, model)
        threads = [threading.Thread(target=load.worker, args=(n,), daemon=True) for n in range(6)]
        for t in threads:
            t.start()
        assert wait_for(lambda: load.count("ok") >= 6, timeout_s=180), load.outcomes
        assert wait_for(lambda: _cluster_view(url).get(DECODE_ID, {}).get("cached_blocks", 0) > 0, timeout_s=30)

        socket_session = SocketSession(url, model)
        socket_thread = threading.Thread(target=socket_session.run, daemon=True)
        socket_thread.start()
        assert socket_session.streaming.wait(180), f"no token on the socket: {socket_session.error!r}"

        agent = next(p for p in psutil.Process(up.pid).children() if DECODE_ID in " ".join(p.cmdline()))
        [core] = [p for p in agent.children(recursive=True) if "EngineCor" in p.name()]
        core.kill()  # what the issue measured: kill -9 of the decode node's VLLM::EngineCore
        t_kill = time.monotonic()
        assert wait_for(lambda: _epoch(r, DECODE_ID) is None, timeout_s=60), "the dead engine stayed registered"
        deregistered_s = time.monotonic() - t_kill
        load.stop.set()  # quiet, so the restarted engine's cache stays empty until we look at the index
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a client is still waiting"
        assert load.count("hung") == 0, load.outcomes
        # A stream the dead engine was serving ends with an OpenAI error event and [DONE], never a cut.
        assert not [o for o in load.outcomes if o.startswith("cut")], load.outcomes

        # The socket's response ended with response.failed; the same socket answers the next one.
        socket_session.again.set()
        socket_thread.join(300)
        assert socket_session.error is None and not socket_thread.is_alive(), repr(socket_session.error)
        assert socket_session.ends[0] == "response.failed", socket_session.ends
        assert socket_session.ends[1] in ("response.completed", "response.incomplete"), socket_session.ends

        # With no decode node left, a P/D request falls back to colocated serving on the prefill node.
        body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Still there?"}]}
        alone = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert alone.status_code == 200, alone.text
        if _epoch(r, DECODE_ID) is None:  # still away when it was answered (a restart takes tens of s)
            assert alone.json()["usage"]["tandem"]["mode"] == "colocated", alone.json()["usage"]

        assert wait_for(lambda: (_epoch(r, DECODE_ID) or 0) > first_epoch, timeout_s=300), (
            "the decode node did not come back with a new epoch"
        )
        # `tandem up` runs two router replicas on one SO_REUSEPORT socket: each GET may reach either, and each
        # learns of the node on its own. Judge the views that list the node, a few of them so both are seen.
        views: list[dict] = []

        def listed_in_views() -> bool:
            view = _cluster_view(url).get(DECODE_ID)
            if view is not None:
                views.append(view)
            return len(views) >= 4

        assert wait_for(listed_in_views, timeout_s=30), "the restarted decode node is not in the router's view"
        assert all(v["cached_blocks"] == 0 for v in views), f"stale index entries of the old engine: {views}"
        assert agent.is_running(), "the node agent itself was restarted: the engine restart is its job"
        assert not any(s.startswith(f"RESTARTED {DECODE_ID}") for s in seen)

        body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Back again?"}]}
        resp = httpx.post(
            f"{url}/v1/chat/completions", json=body, headers={"x-tandem-route": "disaggregated"}, timeout=120
        )
        assert resp.status_code == 200, resp.text
        print(
            f"deregistered {deregistered_s:.1f} s after the kill; outcomes under load: "
            f"{ {o: load.outcomes.count(o) for o in set(load.outcomes)} }"
        )

        pids.update(p.pid for p in psutil.Process(up.pid).children(recursive=True))
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0
        assert wait_for(lambda: not alive_pids(pids), timeout_s=30), f"left alive after SIGTERM: {alive_pids(pids)}"
    finally:
        if load is not None:
            load.stop.set()
        if up.poll() is None:
            up.kill()  # the children's parent-death signal stops the rest
            up.wait()
        for pid in alive_pids(pids):
            os.kill(pid, signal.SIGKILL)
        r.flushdb()
