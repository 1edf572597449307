"""Miss attribution end to end: a workload built to produce each kind of miss gets exactly that
attribution, in ``usage.tandem.miss`` and in the lake, and the kinds sum to the uncached tokens.

Cluster (this module's own): two colocated nodes on small KV caches (24 blocks of 128 tokens each,
one core each), a router in this process (so the test can reach its fleet index and its policy's
guard), the real emitter, and the real lake writer draining into a temporary lake. Redis DB 12.

    cold         a prompt no node has seen
    elsewhere    a prompt node n0 holds, sent while n0 has a request in flight and the load guard
                 (threshold 0 here) sends it to n1: elsewhere_node n0, reason load_guard
    evicted      a prompt n0 held, then pushed out of its 24 blocks by other prompts: evicted from n0,
                 tier GPU (vLLM's device-cache medium, also on CPU)
    undelivered  a prompt n0 holds, whose index entries are moved to n1 on purpose: the router routes
                 to n1, which the index says holds it, and n1's engine reuses nothing

Run under ``flock /tmp/tandem-engines.lock`` on a shared machine (it starts two engines).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bench.standin_engine import ServerThread
from contracts.registry import Role
from contracts.secret import engine_auth_headers
from router.admission.context import AdmissionSettings
from router.edge.app import create_app
from router.kv_index import BlockHasher
from router.policies import CacheAwareConfig
from router.settings import RouterSettings
from telemetry.lake_writer import LakeWriter, WriterConfig
from telemetry.query import query
from tests.support.helpers import on_server_loop, wait_for

pytestmark = pytest.mark.e2e

REDIS_URL = os.environ.get("TANDEM_TEST_REDIS_MISS", "redis://127.0.0.1:6379/12")
PORTS = {"ma-n0": 18500, "ma-n1": 18510}
BLOCKS = 24
BS = 128
KINDS = ("cold", "evicted", "elsewhere", "undelivered")
_WORDS = (
    "alpha beta gamma delta router engine prefix cache block token session tool result module import "
    "function return value index shard queue lease transfer decode prefill stream chunk"
).split()


def _prompt(seed: int, words: int = 520) -> str:
    rng = random.Random(seed)
    return f"[{seed}] " + " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class MissCluster:
    workdir: Path
    url: str = ""
    model: str = ""
    app: Any = None
    server: ServerThread | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def index(self) -> Any:
        return self.app.state.index.get(self.model)

    def on_router_loop(self, fn: Any) -> Any:
        """Run ``fn()`` on the router's event loop (the index is owned by it) and return its result."""
        return on_server_loop(self.server, fn)

    def keys(self, prompt: str) -> list[int]:
        """The router's routing keys for ``prompt`` (tokenized by an engine as the completion will be)."""
        ids = httpx.post(
            f"http://127.0.0.1:{PORTS['ma-n0']}/tokenize",
            json={"model": self.model, "prompt": prompt},
            headers=engine_auth_headers(loopback_only=True),
            timeout=30,
        ).json()["tokens"]
        bs = self.index.block_size if self.index is not None else BS
        assert bs == BS, bs
        return list(BlockHasher(bs, "sha256_cbor").keys(ids))[: (len(ids) - 1) // bs]

    def complete(self, prompt: str) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    def held_by(self, prompt_keys: list[int]) -> dict[str, int]:
        return self.on_router_loop(lambda: self.app.state.index.longest_prefix(self.model, prompt_keys))


@pytest.fixture(scope="module")
def mc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MissCluster]:
    r = redis.Redis.from_url(REDIS_URL)
    r.flushdb()
    c = MissCluster(tmp_path_factory.mktemp("miss"))
    try:
        for i, (node_id, port) in enumerate(PORTS.items()):
            log = (c.workdir / f"{node_id}.log").open("ab")
            args = ["node", "--role", "both", "--port", str(port), "--node-id", node_id, "--redis-url", REDIS_URL]
            args += ["--cores", str(i % max(os.cpu_count() or 1, 1)), "--max-model-len", "2048"]
            args += [f"--engine-arg=--num-gpu-blocks-override={BLOCKS}", "--log-dir", str(c.workdir)]
            c.procs[node_id] = subprocess.Popen(
                [sys.executable, "-m", "tandem", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        admission = AdmissionSettings(
            redis_url=REDIS_URL,
            key_prefix="miss-e2e:",
            database_url=f"sqlite:///{c.workdir}/t.db",
            region="local",
            region_cache_urls={},
        )  # type: ignore[call-arg]
        settings = RouterSettings(
            redis_url=REDIS_URL, registry_refresh_s=1, telemetry=True, admission=admission, tokenize="always"
        )
        c.app = create_app(settings)
        c.server = ServerThread(c.app)
        c.url = c.server.__enter__()

        def ready() -> bool:
            try:
                nodes = httpx.get(f"{c.url}/cluster", timeout=5).json().get("nodes", [])
            except httpx.HTTPError:
                return False
            return {n["node_id"] for n in nodes if n.get("role") == Role.BOTH.value} == set(PORTS)

        for node_id, proc in c.procs.items():
            assert proc.poll() is None, f"{node_id} exited: {(c.workdir / f'{node_id}.log').read_text()[-2000:]}"
        assert wait_for(ready, 600, interval_s=1), "nodes did not register"
        c.model = httpx.get(f"{c.url}/v1/models", timeout=5).json()["data"][0]["id"]
        yield c
    finally:
        if c.server is not None:
            c.server.__exit__(None, None, None)
        for proc in c.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in c.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        r.flushdb()


def _miss(answer: dict[str, Any]) -> dict[str, Any]:
    t = answer["usage"]["tandem"]
    miss = t["miss"]
    assert miss is not None, t
    assert (
        sum(miss[k] for k in KINDS)
        == t["uncached_tokens"]
        == answer["usage"]["prompt_tokens"] - (t["engine_cached_tokens"] or 0)
    )
    return {**miss, "uncached": t["uncached_tokens"], "engine": t["engine_cached_tokens"], "t": t}


def test_each_kind_of_miss_is_attributed_as_such(mc: MissCluster) -> None:
    answers: dict[str, dict[str, Any]] = {}

    # cold: nobody has seen it
    cold = _miss(answers.setdefault("cold", mc.complete(_prompt(1))))
    assert (cold["cold"], cold["evicted"], cold["elsewhere"], cold["undelivered"]) == (cold["uncached"], 0, 0, 0)

    # elsewhere: n0 holds the prompt, has a request in flight, and the guard (threshold 0) sends it to n1
    b = _prompt(2)
    b_keys = mc.keys(b)
    mc.complete(b)
    assert wait_for(lambda: mc.held_by(b_keys).get("ma-n0") == len(b_keys), 30), mc.held_by(b_keys)
    policy = mc.app.state.orchestrator.policy
    policy.config = CacheAwareConfig(imbalance_threshold=0)
    body = {"model": mc.model, "prompt": b, "max_tokens": 64, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{mc.url}/v1/completions", json=body, timeout=300) as held:
        lines = held.iter_lines()
        next(lines)  # n0 is generating for it now: one request in flight there, none on n1
        answers["elsewhere"] = mc.complete(b)
        assert any(line.strip() == "data: [DONE]" for line in lines)  # read to its end
    policy.config = CacheAwareConfig()
    # the held request's queued tokens are settled when its exchange exits: wait for it, so that the
    # cold prompts below tie between the nodes and go to the first by id, n0
    assert wait_for(lambda: not mc.on_router_loop(lambda: dict(policy._queued)), 30)
    away = _miss(answers["elsewhere"])
    assert away["t"]["reason_code"] == "load_guard"
    assert (away["elsewhere_node"], away["elsewhere_reason"]) == ("ma-n0", "load_guard")
    assert away["elsewhere"] == len(b_keys) * BS and away["engine"] == 0
    assert (away["evicted"], away["undelivered"]) == (0, 0) and away["cold"] == away["uncached"] - away["elsewhere"]

    # evicted: n0 held it, then other prompts took its 24 blocks
    d = _prompt(3)
    d_keys = mc.keys(d)
    mc.complete(d)
    assert wait_for(lambda: mc.held_by(d_keys).get("ma-n0") == len(d_keys), 30), mc.held_by(d_keys)
    for seed in range(10, 16):
        mc.complete(_prompt(seed))
    assert wait_for(lambda: not mc.held_by(d_keys), 30), "the flood did not evict the prompt from n0"
    gone = _miss(answers.setdefault("evicted", mc.complete(d)))
    assert gone["evicted"] == len(d_keys) * BS and (gone["elsewhere"], gone["undelivered"]) == (0, 0)
    assert (gone["evicted_node"], gone["evicted_tier"]) == ("ma-n0", "GPU") and gone["evicted_ago_s"] >= 0

    # undelivered: n0 holds it, but the index entries are moved to n1 on purpose
    e = _prompt(4)
    e_keys = mc.keys(e)
    mc.complete(e)
    assert wait_for(lambda: mc.held_by(e_keys) == {"ma-n0": len(e_keys)}, 30), mc.held_by(e_keys)

    def move() -> None:
        mc.index.add_blocks("ma-n1", e_keys)
        mc.index.remove_blocks("ma-n0", e_keys)

    mc.on_router_loop(move)
    lost = _miss(answers.setdefault("undelivered", mc.complete(e)))
    assert lost["t"]["routed_cached_tokens"] == len(e_keys) * BS and lost["engine"] == 0
    assert lost["undelivered"] == len(e_keys) * BS and (lost["elsewhere"], lost["evicted"]) == (0, 0)

    # the lake says the same, row by row
    writer = LakeWriter(WriterConfig(lake=mc.workdir / "lake", redis_url=REDIS_URL, consumer="miss-e2e"))
    ids = {kind: a["id"] for kind, a in answers.items()}
    cols = "response_id, uncached_tokens, " + ", ".join(f"miss_{k}_tokens" for k in KINDS)
    cols += ", miss_elsewhere_node, miss_elsewhere_reason, miss_evicted_node, miss_evicted_tier"

    def rows() -> dict[str, dict[str, Any]]:
        writer.drain()
        lake = mc.workdir / "lake"
        if not lake.is_dir():
            return {}
        got = query(lake, f"SELECT {cols} FROM requests").to_pylist()
        return {r["response_id"]: r for r in got if r["response_id"] in ids.values()}

    try:
        assert wait_for(lambda: len(rows()) == len(ids), 60), rows()
        lake_rows = rows()
    finally:
        writer.close()
    for kind, rid in ids.items():
        row, miss = lake_rows[rid], _miss(answers[kind])
        assert row["uncached_tokens"] == miss["uncached"], kind
        assert {k: row[f"miss_{k}_tokens"] for k in KINDS} == {k: miss[k] for k in KINDS}, kind
        assert row[f"miss_{kind}_tokens"] > 0, kind
        assert (row["miss_elsewhere_node"], row["miss_elsewhere_reason"]) == (
            miss["elsewhere_node"],
            miss["elsewhere_reason"],
        )
        assert (row["miss_evicted_node"], row["miss_evicted_tier"]) == (miss["evicted_node"], miss["evicted_tier"])


AGENT_APIS = {
    "chat": (
        "/v1/chat/completions",
        lambda model, text: {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]},
    ),
    "responses": ("/v1/responses", lambda model, text: {"model": model, "input": text, "max_output_tokens": 1}),
    "messages": (
        "/v1/messages",
        lambda model, text: {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]},
    ),
}


def test_every_apis_rows_name_it_and_keep_the_hit_breakdown_and_miss_attribution(mc: MissCluster) -> None:
    """The same turn sent twice on each API (Chat Completions, Responses, Messages): each row names its API;
    the first is a cold miss whole, the second reuses the first's blocks on the node that holds them, and
    in both the miss kinds sum to the uncached tokens."""
    for n, (api, (path, body)) in enumerate(AGENT_APIS.items()):
        text = _prompt(200 + n, words=300)
        for _ in range(2):
            r = httpx.post(
                f"{mc.url}{path}", json=body(mc.model, text), headers={"x-session-id": f"api-{api}"}, timeout=300
            )
            assert r.status_code == 200, (api, r.text)
    writer = LakeWriter(WriterConfig(lake=mc.workdir / "lake", redis_url=REDIS_URL, consumer="miss-e2e-apis"))
    cols = "session_id, api, t_arrival, uncached_tokens, engine_cached_tokens, routed_cached_tokens, "
    cols += "local_cached_tokens, " + ", ".join(f"miss_{k}_tokens" for k in KINDS)

    def rows() -> dict[str, list[dict[str, Any]]]:
        writer.drain()
        got = query(mc.workdir / "lake", f"SELECT {cols} FROM requests WHERE session_id LIKE 'api-%'").to_pylist()
        out: dict[str, list[dict[str, Any]]] = {}
        for row in sorted(got, key=lambda r: r["t_arrival"]):
            out.setdefault(row["session_id"].removeprefix("api-"), []).append(row)
        return out

    try:
        assert wait_for(lambda: all(len(rows().get(a, [])) == 2 for a in AGENT_APIS), 60), rows()
        by_api = rows()
    finally:
        writer.close()
    for api, (first, second) in by_api.items():
        assert first["api"] == second["api"] == api
        for row in (first, second):
            assert sum(row[f"miss_{k}_tokens"] for k in KINDS) == row["uncached_tokens"], (api, row)
        assert first["miss_cold_tokens"] == first["uncached_tokens"] > 0, (api, first)
        assert second["engine_cached_tokens"] > 0 and second["routed_cached_tokens"] > 0, (api, second)
        assert second["local_cached_tokens"] > 0 and second["uncached_tokens"] < first["uncached_tokens"], (api, second)
