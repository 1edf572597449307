"""Codex CLI and Claude Code, installed from npm as a user installs them, each complete a turn against
`tandem up` (1 prefill + 1 decode node): exit code 0, no protocol error, and the router's lake holds
their requests on /v1/responses and /v1/messages, answered 200.

The cluster is this module's own: its engines serve a context window wide enough for Claude Code's
``max_tokens`` of 32000, a generation config that caps and greedies the answers and a logits processor
that ends each by its 48th token, whatever the host's arithmetic (``infra.agent_clients``, which also
says how each client is pointed at the router and what it sends).
Skipped only when npm itself is missing (the clients are npm packages); an npm install that fails is a
failure.

Redis DB 15 (a module cluster's, like test_several_models); router 23000, nodes 23100 and 23110."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from infra.agent_clients import AgentClients, Endpoint, install, run_claude, run_codex
from infra.agent_clients import agent_node_env as node_env
from telemetry import query
from tests.e2e.conftest import registry_empty
from tests.support.helpers import OutputLines, stop_group, wait_for

pytestmark = pytest.mark.e2e

REDIS_URL = os.environ.get("TANDEM_TEST_REDIS_AGENTS", "redis://127.0.0.1:6379/15")
ROUTER_PORT = 23000
NODE_BASE = 23100
PROMPT = "Reply with one word: hello"
"""A prompt the 135M model answers greedily and ends by itself (see infra.agent_clients)."""
API_KEY = "sk-agent-clients"


@dataclass(frozen=True)
class AgentCluster:
    url: str
    model: str
    lake: Path


@pytest.fixture(scope="module")
def clients() -> AgentClients:
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: Codex CLI and Claude Code are npm packages")
    return install()


@pytest.fixture(scope="module")
def agent_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentCluster]:
    workdir = tmp_path_factory.mktemp("agents-cluster")
    redis.Redis.from_url(REDIS_URL).flushdb()
    cmd = [sys.executable, "-m", "tandem", "up", "--prefill", "1", "--decode", "1", "--routers", "1"]
    cmd += ["--port", str(ROUTER_PORT), "--node-base-port", str(NODE_BASE)]
    cmd += ["--redis-url", REDIS_URL, "--workdir", str(workdir)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **node_env(), "PYTHONUNBUFFERED": "1"},
    )
    try:
        OutputLines(proc).until("READY ", 900, what="tandem up")
        url = f"http://127.0.0.1:{ROUTER_PORT}"
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        yield AgentCluster(url, model, workdir / "lake")
    finally:
        stop_group(proc, workdir / "logs")
    assert registry_empty(REDIS_URL), "nodes still registered after tandem up stopped"


def _rows(cluster: AgentCluster, since: datetime, endpoint: str) -> list[dict[str, Any]]:
    sql = (
        f"SELECT * FROM requests WHERE endpoint = '{endpoint}' "
        f"AND t_arrival >= TIMESTAMPTZ '{since.isoformat()}' ORDER BY t_arrival"
    )
    try:
        return query(cluster.lake, sql).to_pylist()
    except Exception:  # noqa: BLE001 - the table's first file may not exist yet while we poll
        return []


def _landed(cluster: AgentCluster, since: datetime, endpoint: str, at_least: int = 1) -> list[dict[str, Any]]:
    """The requests the lake holds for ``endpoint`` since ``since``, once it holds ``at_least``."""
    landed = wait_for(lambda: len(_rows(cluster, since, endpoint)) >= at_least, timeout_s=60)
    assert landed, f"fewer than {at_least} {endpoint} rows in the lake: {_rows(cluster, since, endpoint)}"
    return _rows(cluster, since, endpoint)


def _endpoint(cluster: AgentCluster) -> Endpoint:
    return Endpoint(cluster.url, cluster.model, API_KEY)


def test_codex_exec_completes_a_turn(agent_cluster: AgentCluster, clients: AgentClients, tmp_path: Path) -> None:
    since = datetime.now(UTC)
    run = run_codex(clients, _endpoint(agent_cluster), PROMPT, tmp_path)
    assert run.returncode == 0, f"codex exec exited {run.returncode}:\n{run.stderr[-4000:]}"
    assert "ERROR" not in run.stderr, run.stderr[-4000:]
    assert run.stdout.strip(), "codex printed no answer"
    rows = _landed(agent_cluster, since, "responses")
    assert [(r["http_status"], r["status"]) for r in rows] == [(200, "ok")] * len(rows)
    assert all(r["stream"] and r["prompt_tokens"] > 1000 and r["completion_tokens"] > 0 for r in rows), rows


def test_codex_exec_over_a_websocket_completes_a_turn(
    agent_cluster: AgentCluster, clients: AgentClients, tmp_path: Path
) -> None:
    """Codex with ``supports_websockets = true``: its model calls come as ``response.create`` messages on
    one socket (the lake's ``transport``: Codex would fall back to HTTP on a refused upgrade, silently)."""
    since = datetime.now(UTC)
    run = run_codex(clients, _endpoint(agent_cluster), PROMPT, tmp_path, websockets=True)
    assert run.returncode == 0, f"codex exec exited {run.returncode}:\n{run.stderr[-4000:]}"
    assert "ERROR" not in run.stderr, run.stderr[-4000:]
    assert run.stdout.strip(), "codex printed no answer"
    rows = _landed(agent_cluster, since, "responses")
    assert [(r["http_status"], r["status"], r["transport"]) for r in rows] == [(200, "ok", "websocket")] * len(rows)
    assert all(r["stream"] and r["prompt_tokens"] > 1000 and r["completion_tokens"] > 0 for r in rows), rows


def test_claude_p_completes_a_turn(agent_cluster: AgentCluster, clients: AgentClients, tmp_path: Path) -> None:
    since = datetime.now(UTC)
    run = run_claude(clients, _endpoint(agent_cluster), PROMPT, tmp_path)
    assert run.returncode == 0, f"claude -p exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    assert run.stdout.strip() and "API Error" not in run.stdout, run.stdout[-2000:]
    rows = _landed(agent_cluster, since, "messages")
    assert [(r["http_status"], r["status"]) for r in rows] == [(200, "ok")] * len(rows)
    assert all(r["stream"] and r["prompt_tokens"] > 1000 and r["completion_tokens"] > 0 for r in rows), rows


def test_claude_p_with_its_default_tools_and_skills_is_served(
    agent_cluster: AgentCluster, clients: AgentClients, tmp_path: Path
) -> None:
    """Claude Code as it runs by default: all 24 tools, and its agents and skills in a mid-conversation
    ``system`` message after the user's prompt. The 135M model copies that message rather than answer;
    the engine's ``EndTurn`` ends the copy, so the turn completes and every request is served: 200, no
    protocol error, and no answer cut at a length cap."""
    since = datetime.now(UTC)
    run = run_claude(clients, _endpoint(agent_cluster), PROMPT, tmp_path, tools=None)
    assert run.returncode == 0, f"claude -p exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    assert "API Error" not in run.stdout, run.stdout[-2000:]
    rows = _landed(agent_cluster, since, "messages")
    assert all(r["finish_reason"] != "length" for r in rows), rows
    assert [(r["http_status"], r["status"]) for r in rows] == [(200, "ok")] * len(rows)
