"""Two real clusters on one machine and one Redis, same model, host tiers on, kept apart by their names
(``tandem up --cluster``): each router's fleet holds only its nodes, its requests reach only its own
engine (counted by the engines themselves), the tiers are two files, keys, tenants, response ids and
sessions of one are unknown to the other, and each lake holds only its own rows.

Both clusters use the tenant name ``acme`` and the same session ids, so nothing but the cluster name
keeps their keys, limits and histories apart. They share Redis database 1 with the session's own
cluster (named ``default``), a third cluster on the same server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from contracts.cluster import prefix
from tests.conftest import REDIS_E2E_URL
from tests.e2e.conftest import engine_metric
from tests.support.helpers import OutputLines, stop_group, wait_for

pytestmark = pytest.mark.e2e

NAMES = ("e2e-a", "e2e-b")
PORTS = {"e2e-a": 18900, "e2e-b": 18950}
REQUESTS = 50
TIER = "64MiB"
START_TIMEOUT_S = 900


@dataclass
class Running:
    name: str
    url: str
    engine_url: str
    workdir: Path
    key: str = ""
    model: str = ""

    @property
    def lake(self) -> Path:
        return self.workdir / "lake"

    def env(self) -> dict[str, str]:
        """What a tool started beside this cluster (``tandem keys``) needs to reach its state."""
        return {
            **os.environ,
            "TANDEM_CLUSTER": self.name,
            "TANDEM_REDIS_URL": REDIS_E2E_URL,
            "TANDEM_SQLITE_PATH": str(self.workdir / "tandem.db"),
        }

    def headers(self, key: str | None = None, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.key}", **extra}


def _up(name: str, workdir: Path) -> subprocess.Popen[str]:
    port = PORTS[name]
    cmd = [sys.executable, "-m", "tandem", "up", "--cluster", name, "--colocated", "--both", "1"]
    cmd += ["--dtype", "float32", "--port", str(port), "--node-base-port", str(port + 10), "--routers", "1"]
    cmd += ["--redis-url", REDIS_E2E_URL, "--workdir", str(workdir), "--host-tier", TIER]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _forget(name: str) -> None:
    """Whatever an earlier, killed run of this test left under the cluster's prefix."""
    r = redis.Redis.from_url(REDIS_E2E_URL)
    for k in r.scan_iter(match=prefix(name) + "*", count=1000):
        r.delete(k)


def _create_key(c: Running) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "keys", "create", "--tenant", "acme", "--admin"],
        env=c.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Running]]:
    procs: dict[str, subprocess.Popen[str]] = {}
    running: dict[str, Running] = {}
    try:
        for name in NAMES:
            _forget(name)
            workdir = tmp_path_factory.mktemp(name)
            procs[name] = _up(name, workdir)
            port = PORTS[name]
            running[name] = Running(name, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 10}", workdir)
        for name in NAMES:
            OutputLines(procs[name]).until("READY ", START_TIMEOUT_S, what=f"tandem up --cluster {name}")
        for c in running.values():
            c.key = _create_key(c)
            # auth is on once a key exists: wait until this router says so
            assert wait_for(lambda c=c: httpx.get(f"{c.url}/v1/models").status_code == 401, 30)
            c.model = httpx.get(f"{c.url}/v1/models", headers=c.headers()).json()["data"][0]["id"]
        yield running
    finally:
        for name, proc in procs.items():
            stop_group(proc, running[name].workdir / "logs")
        for name in NAMES:
            _forget(name)


def _chat(c: Running, content: str, key: str | None = None, **headers: str) -> httpx.Response:
    body = {"model": c.model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{c.url}/v1/chat/completions", json=body, headers=c.headers(key, **headers), timeout=120)


def test_each_router_sees_only_its_own_node(clusters: dict[str, Running]) -> None:
    for c in clusters.values():
        nodes = httpx.get(f"{c.url}/cluster", headers=c.headers(), timeout=30).json()["nodes"]
        assert [n["url"] for n in nodes] == [c.engine_url], f"{c.name}'s fleet: {nodes}"


def test_requests_reach_only_their_own_clusters_engine(clusters: dict[str, Running]) -> None:
    a, b = clusters["e2e-a"], clusters["e2e-b"]
    before = {c.name: engine_metric(c.engine_url, "vllm:request_success_total") for c in (a, b)}
    with ThreadPoolExecutor(4) as pool:
        jobs = [
            pool.submit(_chat, c, f"{c.name} request {i}: say yes", **{"x-session-id": f"s{i % 5}"})
            for i in range(REQUESTS)
            for c in (a, b)
        ]
        codes = [j.result().status_code for j in jobs]
    assert codes == [200] * (2 * REQUESTS)
    for c in (a, b):
        # the engines' own counters: each engine served its router's requests and none of the other's
        done = engine_metric(c.engine_url, "vllm:request_success_total") - before[c.name]
        assert done == REQUESTS, f"{c.name}'s engine served {done}"


def test_the_two_host_tiers_are_different_files(clusters: dict[str, Running]) -> None:
    files = {name: sorted(Path("/dev/shm").glob(f"tandem-tier-{name}-*")) for name in NAMES}
    assert all(len(f) == 1 for f in files.values()), files
    a, b = (files[n][0] for n in NAMES)
    assert a.stat().st_ino != b.stat().st_ino


def test_keys_tenants_responses_and_sessions_of_one_are_unknown_to_the_other(clusters: dict[str, Running]) -> None:
    a, b = clusters["e2e-a"], clusters["e2e-b"]
    # the same tenant name in both, yet each cluster's key is a stranger to the other's router
    assert _chat(b, "hello", key=a.key).status_code == 401
    assert _chat(a, "hello", key=b.key).status_code == 401
    # a stored response of A: B has never heard of it
    made = httpx.post(
        f"{a.url}/v1/responses",
        json={"model": a.model, "input": "say yes", "max_output_tokens": 2, "temperature": 0},
        headers=a.headers(),
        timeout=120,
    )
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    assert httpx.get(f"{a.url}/v1/responses/{rid}", headers=a.headers(), timeout=30).status_code == 200
    assert httpx.get(f"{b.url}/v1/responses/{rid}", headers=b.headers(), timeout=30).status_code == 404
    chained = httpx.post(
        f"{b.url}/v1/responses",
        json={"model": b.model, "input": "and then?", "previous_response_id": rid, "max_output_tokens": 2},
        headers=b.headers(),
        timeout=120,
    )
    assert chained.status_code in (400, 404), chained.text
    # a session's stored history: A prepends it, B (same tenant name, same session id) has none
    session = {"x-session-id": "shared-session", "x-tandem-history": "server"}
    first = "remember the word lighthouse " * 8
    assert _chat(a, first, **session).status_code == 200
    fresh = _chat(b, "what was the word?", **{"x-session-id": "never-used"}).json()["usage"]["prompt_tokens"]

    def a_has_history() -> bool:
        got = _chat(a, "what was the word?", **session).json()["usage"]["prompt_tokens"]
        return got > fresh + 8

    assert wait_for(a_has_history, 30), "A never prepended its own session's history"
    on_b = _chat(b, "what was the word?", **session).json()["usage"]["prompt_tokens"]
    assert on_b == fresh, f"B prepended {on_b - fresh} tokens of history it should not have"


def test_each_lake_holds_only_its_own_rows(clusters: dict[str, Running]) -> None:
    from telemetry.query import query

    nodes = {
        c.name: httpx.get(f"{c.url}/cluster", headers=c.headers()).json()["nodes"][0]["node_id"]
        for c in clusters.values()
    }

    def rows(c: Running) -> list[dict[str, object]]:
        try:
            return query(c.lake, "SELECT decode_node, source FROM requests").to_pylist()
        except Exception:  # noqa: BLE001 - the table's first file may not exist yet while we poll
            return []

    for c in clusters.values():
        assert wait_for(lambda c=c: len(rows(c)) >= REQUESTS, 120), f"{c.name}'s lake: {len(rows(c))} rows"
        served = {r["decode_node"] for r in rows(c)}
        assert served == {nodes[c.name]}, f"{c.name}'s lake holds rows of {served}"
