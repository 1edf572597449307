"""Two router replicas on one port (``--reuse-port``, as ``tandem up`` runs them): both listen, and
when one is killed every new request is answered by the other, with no gap to wait out.

Real router processes over a STAND-IN engine (``bench.standin_engine``), registered in the real Redis
registry (DB 7)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from bench.standin_engine import ServerThread, StandInEngine, free_port
from contracts.registry import NodeInfo, Role
from node_agent.model import default_model_dir
from tests.support.standin_cluster import REDIS_URL, deregister_nodes, register_nodes


def _listening(pid: int, port: int) -> bool:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[str, str, list[subprocess.Popen[bytes]]]]:
    model = f"replicas-{uuid.uuid4().hex[:8]}"
    engine = StandInEngine(stream_tokens=8)
    with ServerThread(engine.app) as engine_url:
        node = NodeInfo(
            node_id=f"standin-{model}",
            role=Role.BOTH,
            model=model,
            url=engine_url,
            block_size=16,
            max_model_len=4096,
            kv_connector="none",
            model_path=str(default_model_dir()),
        )
        asyncio.run(register_nodes([node]))
        port = free_port()
        env = {**os.environ, "TANDEM_SQLITE_PATH": str(tmp_path / "keys.db"), "TANDEM_ROUTER_TELEMETRY": "false"}
        cmd = [sys.executable, "-m", "tandem", "router", "--port", str(port), "--reuse-port", "--redis-url", REDIS_URL]
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
        try:
            end = time.monotonic() + 120
            while not all(_listening(p.pid, port) for p in procs):
                assert all(p.poll() is None for p in procs), "a replica exited: the port could not be shared"
                assert time.monotonic() < end, "replicas did not start listening"
                time.sleep(0.2)  # polling another process's sockets: nothing to wait on
            yield f"http://127.0.0.1:{port}", model, procs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    p.wait(30)
            asyncio.run(deregister_nodes([node.node_id]))


def _ask(url: str, model: str) -> httpx.Response:
    # A new connection per request, as a client whose keep-alive connection died would open.
    with httpx.Client(timeout=30) as client:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            resp.read()
            return resp


def test_a_killed_replica_leaves_the_other_serving_every_new_request(replicas) -> None:  # noqa: ANN001
    url, model, procs = replicas
    before = [_ask(url, model) for _ in range(10)]
    assert all(r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") for r in before)
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait(10)
    after = [_ask(url, model) for _ in range(30)]
    assert [r.status_code for r in after] == [200] * 30
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in after)
    assert procs[1].poll() is None
