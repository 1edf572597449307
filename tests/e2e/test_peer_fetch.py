"""Cross-node prefix reuse on real engines (``router.planning.peer_fetch``): two colocated float32 nodes that run
our connector (``tandem node --peer-kv``) and a router in this process (Redis DB 10, ``least_loaded``,
so every request goes to the node named first while the other holds the prefixes). The node loads
each prompt's prefix from its peer and computes the rest, with the same greedy tokens the peer's own
prefill gave, and the router says how many prompt tokens came from the peer; a source that dies after
leasing (before the pull) leaves the request computed, with nothing held on the serving node, and
one the router cannot reach is computed around."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bench.standin_engine import ServerThread
from contracts.secret import engine_auth_headers
from contracts.transfer import TransferParams
from kv_transfer import prefill_request_params
from node_agent.model import default_model_dir
from router.kv_index import BlockHasher
from tests.support.helpers import (
    colocated_node_command,
    engine_healthy,
    in_process_router,
    on_server_loop,
    wait_for,
)

pytestmark = pytest.mark.e2e

REDIS_URL = os.environ.get("TANDEM_TEST_REDIS_PEER", "redis://127.0.0.1:6379/10")
BLOCK = 32
SERVING, SOURCE = ("peer-a", 18180), ("peer-b", 18190)
"""least_loaded breaks ties by node id: idle, every routed request goes to peer-a."""
PREFIXES = [
    " ".join(f"shared context {p} line {i}: def tool_{p}_{i}(args): return run(args, {i})" for i in range(14))
    for p in range(5)
]
AUTH = engine_auth_headers(loopback_only=True)
SPLIT_MIN = 512
"""Cold prompts of at least this many tokens are split across the two idle nodes
(``router.planning.split_prefill``); every prompt of the fetch tests is shorter, or held by the peer."""


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not want or want in line) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Running:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = default_model_dir()
        self.env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.app: Any = None
        self.server: ServerThread | None = None
        self.url = ""

    def start(self) -> None:
        log = (self.tmp / "procs.log").open("ab")
        for (name, port), core in ((SERVING, "0"), (SOURCE, "1")):
            cmd = colocated_node_command(
                port, name, REDIS_URL, self.tmp, "--cores", core, "--block-size", str(BLOCK), "--peer-kv"
            )
            self.procs[name] = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start_router(self) -> None:
        self.app, self.server, self.url = in_process_router(
            REDIS_URL,
            self.tmp,
            "peer-e2e:",
            policy="least_loaded",
            tokenize="always",
            peer_fetch_min_tokens=2 * BLOCK,
            split_prefill_min_tokens=SPLIT_MIN,
        )

    def stop(self) -> None:
        if self.server is not None:
            self.server.__exit__(None, None, None)
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(60)

    def kill(self, name: str) -> None:
        """The node's agent and engine killed outright: nothing deregisters, nothing hands a lease back."""
        p = self.procs[name]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(60)

    def engine(self, port: int, body: dict[str, Any]) -> dict[str, Any]:
        body = {"model": self.model.name, "max_tokens": 12, "temperature": 0, **body}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=AUTH, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def routed(self, prompt: str) -> dict[str, Any]:
        body = {"model": self.model.name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        resp = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def ids(self, prompt: str) -> list[int]:
        resp = httpx.post(
            f"http://127.0.0.1:{SERVING[1]}/tokenize",
            json={"model": self.model.name, "prompt": prompt},
            headers=AUTH,
            timeout=30,
        )
        return list(resp.json()["tokens"])

    def held(self, node: str, prompt: str) -> int:
        """Leading blocks of ``prompt`` the router's index says ``node``'s engine holds."""
        ids = self.ids(prompt)
        keys = list(BlockHasher(BLOCK, "sha256_cbor").keys(ids))[: (len(ids) - 1) // BLOCK]
        own = on_server_loop(self.server, lambda: self.app.services.index.own_prefix(self.model.name, keys))
        return int(own.get(node, 0))

    def router_sees_idle(self, node: str) -> bool:
        """Whether the router's view of ``node`` (its last heartbeat) shows no work and no KV in use:
        least_loaded then prefers it to any other node, or ties and takes it by name."""
        nodes = httpx.get(f"{self.url}/cluster", timeout=5).json().get("nodes", [])
        return any(
            n["node_id"] == node and n["running"] == n["waiting"] == n["router_inflight"] == 0 and n["kv_usage"] == 0
            for n in nodes
        )

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def engine_idle(self, port: int) -> bool:
        page = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH, timeout=10).text
        return _metric(page, "vllm:num_requests_running") == 0 and _metric(page, "vllm:kv_cache_usage_perc") == 0


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    redis.Redis.from_url(REDIS_URL).flushdb()
    r = Running(tmp_path_factory.mktemp("peer-fetch"))
    r.start()
    try:
        for _, port in (SERVING, SOURCE):
            assert wait_for(lambda port=port: engine_healthy(port), timeout_s=300), (r.tmp / "procs.log").read_text()[
                -3000:
            ]
        r.start_router()

        def registered() -> bool:
            nodes = httpx.get(f"{r.url}/cluster", timeout=5).json().get("nodes", [])
            return sorted(n["node_id"] for n in nodes) == [SERVING[0], SOURCE[0]]

        assert wait_for(registered, timeout_s=60), "the nodes did not register"
        yield r
    finally:
        r.stop()
        redis.Redis.from_url(REDIS_URL).flushdb()


def test_a_prefix_loaded_from_a_peer_gives_the_tokens_the_peer_computed(running: Running) -> None:
    for p, prefix in enumerate(PREFIXES):
        prompt = f"{prefix}\nQuestion {p}: which tool handles line 3?"
        # the peer computes the whole prompt from nothing: the reference, and the prefix now cached there
        reference = running.engine(SOURCE[1], {"prompt": prompt})
        assert (reference["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
        blocks = (len(running.ids(prompt)) - 1) // BLOCK  # every block vLLM could reuse of it
        assert wait_for(lambda prompt=prompt, blocks=blocks: running.held(SOURCE[0], prompt) == blocks, timeout_s=30)
        assert running.held(SERVING[0], prompt) == 0
        assert wait_for(lambda: running.router_sees_idle(SERVING[0]), timeout_s=30)  # (the last prompt's heartbeat)
        answer = running.routed(prompt)
        assert answer["choices"][0]["text"] == reference["choices"][0]["text"]  # float32 greedy: the same
        usage = answer["usage"]
        origin = usage["tandem"]["kv_origin"]
        prefix_tokens = blocks * BLOCK
        assert usage["tandem"]["routed_cached_tokens"] == prefix_tokens, usage  # the peer leased it all ...
        assert origin["peer"] == prefix_tokens and origin["engine"] == 0, (p, usage["tandem"])  # ... and loaded
        assert origin["computed"] == usage["prompt_tokens"] - prefix_tokens
    page = running.metrics()
    assert _metric(page, "tandem_peer_fetch_total", outcome="fetched") == len(PREFIXES)
    assert wait_for(lambda: running.engine_idle(SERVING[1]) and running.engine_idle(SOURCE[1]), timeout_s=30)


def test_a_cold_prompt_split_across_two_idle_nodes_gives_the_tokens_of_one(running: Running) -> None:
    """Split prefill: the peer computes the prefix while the serving node computes the rest, each of its
    layers waiting for the peer's; the answer is the one a single engine gives, nothing counts as a
    cache hit (the prefix was computed, by the peer), and both engines end with nothing held."""
    prompt = "\n".join(PREFIXES[:2]).replace("shared", "split") + "\nQuestion: which tool handles line 7?"
    n = len(running.ids(prompt))
    assert n >= SPLIT_MIN and running.held(SOURCE[0], prompt) == running.held(SERVING[0], prompt) == 0
    assert wait_for(lambda: running.router_sees_idle(SERVING[0]) and running.router_sees_idle(SOURCE[0]), timeout_s=30)
    before = _metric(running.metrics(), "tandem_peer_fetch_total", outcome="split")
    answer = running.routed(prompt)
    assert _metric(running.metrics(), "tandem_peer_fetch_total", outcome="split") == before + 1
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, answer["usage"]
    origin = answer["usage"]["tandem"]["kv_origin"]
    assert origin["engine"] == origin["peer"] == 0 and origin["computed"] == n, origin
    # the helper computed the prefix (its engine holds it now) and the serving node the whole prompt's KV.
    # Which node serves is least_loaded's choice from the heartbeats it routed on, not the ones this test
    # waited for: peer-a by name when both show idle, yet in CI peer-b served and peer-a helped.
    prefix = n // 2 // BLOCK * BLOCK
    want = sorted((prefix // BLOCK, (n - 1) // BLOCK))

    def seen() -> str:  # what a failure below says: each node's blocks, and whether a pull failed
        failed = [
            _metric(
                httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH, timeout=10).text,
                "tandem_kv_transfer_failures_total",
            )
            for port in (SERVING[1], SOURCE[1])
        ]
        held = {node: running.held(node, prompt) for node, _ in (SERVING, SOURCE)}
        return f"held: {held}; pull failures {failed}"

    def split() -> bool:
        return sorted(running.held(node, prompt) for node, _ in (SERVING, SOURCE)) == want

    assert wait_for(split, timeout_s=30), (want, seen())
    helper = SOURCE if running.held(SOURCE[0], prompt) == want[0] else SERVING
    reference = running.engine(helper[1], {"prompt": prompt})  # the helper alone: its prefix, then the rest
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"]  # float32 greedy: the same
    assert wait_for(lambda: running.engine_idle(SERVING[1]) and running.engine_idle(SOURCE[1]), timeout_s=30)


def test_a_source_that_dies_leaves_every_request_computed(running: Running) -> None:
    prompt = PREFIXES[0].replace("shared", "leased") + "\nWhat does tool 2 return?"
    ids = running.ids(prompt)
    prefix = (len(ids) - 1) // BLOCK * BLOCK
    # what the router's source leg does: the peer leases the prefix's blocks and says where they wait
    leased = running.engine(
        SOURCE[1], {"prompt": ids[:prefix], "max_tokens": 1, "kv_transfer_params": prefill_request_params()}
    )
    params = TransferParams.from_dict(leased["kv_transfer_params"])
    assert len(params.remote_block_ids) >= prefix // BLOCK
    # a long context the source holds: a fetch of it beats computing it by far, whatever the measured rates
    context = "\n".join(PREFIXES[2:]).replace("shared", "long")
    running.engine(SOURCE[1], {"prompt": context, "max_tokens": 1})
    routed = context + "\nQuestion again: which tool handles line 5?"
    held = (len(running.ids(context)) - 1) // BLOCK
    assert wait_for(lambda: running.held(SOURCE[0], routed) >= held, timeout_s=30)
    assert wait_for(lambda: running.router_sees_idle(SERVING[0]), timeout_s=30)
    running.kill(SOURCE[0])  # ... and dies before the serving node pulls, its registry entry not lapsed

    # the router plans a fetch from it, cannot reach it, and has the serving node compute the prompt
    before = _metric(running.metrics(), "tandem_peer_fetch_total", outcome="source_failed")
    answer = running.routed(routed)
    assert answer["usage"]["tandem"]["kv_origin"]["peer"] == 0
    assert _metric(running.metrics(), "tandem_peer_fetch_total", outcome="source_failed") == before + 1

    # the serving node given the dead source's lease: its pull fails, it computes, and holds nothing after
    key = BlockHasher(BLOCK, "sha256_cbor").keys(ids)[prefix // BLOCK - 1]  # what the router sends with it
    fetched = {**params.to_dict(), "prefix_tokens": prefix, "prefix_key": key}
    answer = running.engine(SERVING[1], {"prompt": prompt, "kv_transfer_params": fetched})
    computed = running.engine(SERVING[1], {"prompt": prompt})  # the same prompt, now the node's own hit
    assert answer["choices"][0]["text"] == computed["choices"][0]["text"]
    assert wait_for(lambda: running.engine_idle(SERVING[1]), timeout_s=30)  # no block held for the pull
