"""Kill a node and start it again: its blocks leave the router's index when it leaves the registry, and
after the restart routing predicts no stale hits (routed_cached_tokens equals the engine's figure)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from contracts.secret import engine_auth_headers
from router.edge.app import create_app
from router.settings import RouterSettings
from tests.e2e.conftest import LiveCluster
from tests.e2e.test_cache_routing import SYSTEM
from tests.support.helpers import colocated_node_command, wait_for

pytestmark = pytest.mark.e2e

PORT = 18160
NODE_ID = "restart-both-18160"


def _start_node(cluster: LiveCluster, log: Path) -> subprocess.Popen[bytes]:
    cmd = colocated_node_command(PORT, NODE_ID, cluster.redis_url, log.parent, "--cores", "1")
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_killed_node_leaves_the_index_and_returns_without_stale_hits(cluster: LiveCluster, tmp_path: Path) -> None:
    settings = RouterSettings(redis_url=cluster.redis_url, policy="cache_aware", telemetry=False)
    messages = [
        {"role": "system", "content": "Restart test. " + SYSTEM},
        {"role": "user", "content": "Which file routes requests?"},
    ]
    body = {"model": cluster.model, "messages": messages, "max_tokens": 4, "temperature": 0}
    node = _start_node(cluster, tmp_path / "node.log")
    try:
        with TestClient(create_app(settings)) as client:
            state = client.app.state

            def ids() -> set[str]:
                return {n.info.node_id for n in state.fleet.nodes}

            def blocks() -> int:
                return state.index.block_counts().get(cluster.model, {}).get(NODE_ID, 0)

            def fill_node_cache() -> None:  # straight to the node's engine, so the blocks land there
                url, key = f"http://127.0.0.1:{PORT}/v1/chat/completions", engine_auth_headers(loopback_only=True)
                resp = httpx.post(url, json=body, headers=key, timeout=120)
                assert resp.status_code == 200, resp.text

            assert wait_for(lambda: NODE_ID in ids(), timeout_s=600), (tmp_path / "node.log").read_text()[-2000:]
            fill_node_cache()
            assert wait_for(lambda: blocks() > 0, timeout_s=15), "the node's blocks never reached the index"

            os.killpg(node.pid, signal.SIGKILL)  # the agent dies at once; its engine follows (parent-death signal)
            node.wait()
            # No deregistration happens on SIGKILL: the heartbeat lapses and the node leaves the registry.
            assert wait_for(lambda: NODE_ID not in ids(), timeout_s=30)
            assert wait_for(lambda: blocks() == 0, timeout_s=10), "a dead node's blocks stayed in the index"
            assert wait_for(lambda: _port_free(PORT), timeout_s=60), "the killed node's engine is still serving"

            node = _start_node(cluster, tmp_path / "node.log")
            assert wait_for(lambda: NODE_ID in ids(), timeout_s=600), (tmp_path / "node.log").read_text()[-2000:]
            assert blocks() == 0  # the same node id came back with an empty cache, and the index agrees
            resp = client.post("/v1/chat/completions", json=body, headers={"x-tandem-route": "colocated"})
            assert resp.status_code == 200, resp.text
            t = resp.json()["usage"]["tandem"]
            assert t["routed_cached_tokens"] == t["engine_cached_tokens"], t  # no stale hit predicted
            fill_node_cache()
            assert wait_for(lambda: blocks() > 0, timeout_s=15), "routing did not recover the restarted node's blocks"
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGTERM)
            node.wait(60)
