"""A real engine with the host tier (``tandem node --host-tier``, ``HostTierConnector``): a prompt's blocks
go to the tier when its request ends; after the engine's own cache is emptied the prompt is served from
the tier with the same greedy tokens (float32); a corrupted tier block is detected and recomputed, never
served. A router in this process (Redis DB 10) reads the tier's events and says, per request, how many
prompt tokens came from the engine's own cache and how many from the tier (``usage.tandem.kv_origin``)."""

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
from host_tier.client import TierClient
from host_tier.settings import layout_from_model
from node_agent.model import default_model_dir
from router.kv_index import BlockHasher
from tests.support.helpers import (
    colocated_node_command,
    engine_healthy,
    in_process_router,
    on_server_loop,
    tier_serve_command,
    wait_for,
)

pytestmark = pytest.mark.e2e

REDIS_URL = os.environ.get("TANDEM_TEST_REDIS_TIER", "redis://127.0.0.1:6379/10")
PORT = 18170
BLOCK = 32
PROMPTS = [
    " ".join(
        f"tier line {i} of prompt {p}: def handler_{p}_{i}(request): return route(request, {i})" for i in range(12)
    )
    for p in range(5)
]


class Running:
    """A host tier and one colocated float32 node on ``port`` using it (``node_args`` added to its
    command line), with a router in this process once ``start_router`` ran."""

    def __init__(self, tmp: Path, port: int = PORT, node_args: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.port = port
        self.node_args = node_args
        self.model = default_model_dir()
        self.layout = layout_from_model(self.model, "float32", BLOCK)
        self.endpoint = f"ipc://{tmp}/tier.sock"
        self.env = {
            **os.environ,
            "TANDEM_TIER_DIR": str(tmp),
            "TANDEM_TIER_ENDPOINT": self.endpoint,
            "TANDEM_TIER_EVENTS_ENDPOINT": f"ipc://{tmp}/tier-events.sock",
            "TANDEM_TIER_REPLAY_ENDPOINT": f"ipc://{tmp}/tier-replay.sock",
            "VLLM_SERVER_DEV_MODE": "1",
            # generous on a shared 2-core host: a lookup that times out would turn the tier off for 10 s
            "TANDEM_NODE_HOST_TIER_TIMEOUT_S": "30",
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.app: Any = None
        self.server: ServerThread | None = None
        self.url = ""

    def start(self) -> None:
        log = (self.tmp / "procs.log").open("ab")
        tier = tier_serve_command(self.model, "float32", BLOCK, 256 * self.layout.block_bytes)
        node = colocated_node_command(
            self.port,
            f"tier-{self.port}",
            REDIS_URL,
            self.tmp,
            "--cores",
            "1",
            "--block-size",
            str(BLOCK),
            "--host-tier",
            self.endpoint,
            *self.node_args,
        )
        for cmd in (tier, node):
            self.procs.append(
                subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def start_router(self) -> None:
        # tokenize=always: with one node the router would not hash prompts (no routing choice to make)
        self.app, self.server, self.url = in_process_router(REDIS_URL, self.tmp, "tier-e2e:", tokenize="always")

    def on_router_loop(self, fn: Any) -> Any:
        """Run ``fn()`` on the router's event loop (the index is owned by it) and return its result."""
        return on_server_loop(self.server, fn)

    def split(self, prompt: str) -> tuple[int, int]:
        """What the router's index says of ``prompt`` on the node: (own blocks, tier blocks after them)."""
        ids = httpx.post(
            f"http://127.0.0.1:{self.port}/tokenize",
            json={"model": self.model.name, "prompt": prompt},
            headers=engine_auth_headers(loopback_only=True),
            timeout=30,
        ).json()["tokens"]
        keys = list(BlockHasher(BLOCK, "sha256_cbor").keys(ids))[: (len(ids) - 1) // BLOCK]
        return self.on_router_loop(lambda: self.app.services.index.split(self.model.name, keys, f"tier-{self.port}"))

    def routed(self, prompt: str) -> dict[str, Any]:
        body = {"model": self.model.name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        resp = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def stop(self) -> None:
        if self.server is not None:
            self.server.__exit__(None, None, None)
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(60)

    def complete(self, prompt: str) -> tuple[str, int]:
        resp = httpx.post(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json={"model": self.model.name, "prompt": prompt, "max_tokens": 12, "temperature": 0},
            headers=engine_auth_headers(loopback_only=True),
            timeout=300,
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        details = body["usage"].get("prompt_tokens_details") or {}
        return body["choices"][0]["text"], int(details.get("cached_tokens") or 0)

    def reset_engine_cache(self) -> None:
        resp = httpx.post(
            f"http://127.0.0.1:{self.port}/reset_prefix_cache",
            headers=engine_auth_headers(loopback_only=True),
            timeout=60,
        )
        assert resp.status_code == 200, resp.text


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    redis.Redis.from_url(REDIS_URL).flushdb()
    r = Running(tmp_path_factory.mktemp("host-tier"))
    r.start()
    try:
        assert wait_for(lambda: engine_healthy(PORT), timeout_s=300), (r.tmp / "procs.log").read_text()[-3000:]
        r.start_router()

        def registered() -> bool:
            nodes = httpx.get(f"{r.url}/cluster", timeout=5).json().get("nodes", [])
            return [n["node_id"] for n in nodes] == [f"tier-{PORT}"]

        assert wait_for(registered, timeout_s=60), "the node did not register"
        yield r
    finally:
        r.stop()
        redis.Redis.from_url(REDIS_URL).flushdb()


def test_an_emptied_engine_cache_is_refilled_from_the_tier_with_the_same_tokens(running: Running) -> None:
    tier = TierClient(running.endpoint, running.layout.fingerprint(), timeout_s=30)
    first = [running.complete(p) for p in PROMPTS]
    assert all(cached == 0 for _, cached in first)
    assert wait_for(lambda: tier.stats().stored >= len(PROMPTS), timeout_s=30), tier.stats()
    running.reset_engine_cache()
    again = [running.complete(p) for p in PROMPTS]
    for (text0, _), (text1, cached) in zip(first, again, strict=True):
        assert text1 == text0  # float32 greedy: loaded KV gives the tokens computed KV gave
        assert cached >= BLOCK, "the prompt was computed again, not loaded from the tier"
    assert tier.stats().hits > 0


def test_a_corrupted_tier_block_is_recomputed_not_served(running: Running) -> None:
    tier = TierClient(running.endpoint, running.layout.fingerprint(), timeout_s=30)
    prompt = PROMPTS[0] + " and one more line for the corruption test"
    text0, _ = running.complete(prompt)
    assert wait_for(lambda: tier.stats().held > 0, timeout_s=30)
    arena = tier.arena
    for slot in range(arena.n_slots):  # flip a byte in every block the tier holds
        if arena.gen(slot) and arena.gen(slot) % 2 == 0:
            arena.data(slot)[64] ^= 0x5A
    running.reset_engine_cache()
    before = tier.stats().forgotten.get("corrupt", 0)
    text1, cached = running.complete(prompt)
    assert text1 == text0  # computed again from the failed block on: the same tokens
    assert tier.stats().forgotten.get("corrupt", 0) > before  # detected, and dropped from the tier
    # vLLM's prompt_tokens_details.cached_tokens still counts the tokens the connector claimed before
    # the load failed (its prefill stats are taken at scheduling), so it is not asserted here.
    text2, cached2 = running.complete(prompt)
    assert text2 == text0 and cached2 >= BLOCK  # recomputed blocks are the engine's own hits again


def test_the_router_knows_what_the_tier_holds_and_says_where_each_token_came_from(running: Running) -> None:
    # its own first words: no block shared with the prompts above (the corruption test left their
    # unread tier blocks corrupt, which a load would detect and recompute)
    prompt = "Routed through the router: " + PROMPTS[1]
    tier = TierClient(running.endpoint, running.layout.fingerprint(), timeout_s=30)
    stored = tier.stats().stored
    first = running.routed(prompt)
    origin = first["usage"]["tandem"]["kv_origin"]
    assert origin["host_tier"] == 0 and origin["computed"] == first["usage"]["prompt_tokens"] - origin["engine"]
    # the prompt's blocks reach the tier one engine step after the request ends (vLLM refuses to reset
    # its cache while the connector still holds them)
    blocks = first["usage"]["prompt_tokens"] // BLOCK
    assert wait_for(lambda: tier.stats().stored >= stored + blocks, timeout_s=30), tier.stats()
    running.reset_engine_cache()  # the engine's AllBlocksCleared empties its part of the index ...
    running.complete("hi")  # ... published at the engine's next step (an idle engine publishes nothing)
    assert wait_for(lambda: running.split(prompt)[0] == 0 and running.split(prompt)[1] > 0, timeout_s=30), (
        running.split(prompt),
        running.on_router_loop(lambda: running.app.services.index.block_counts()),
        running.on_router_loop(lambda: {k: str(v) for k, v in running.app.services.subscribers.stats().items()}),
    )
    own, tier_blocks = running.split(prompt)
    again = running.routed(prompt)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    usage = again["usage"]
    t = usage["tandem"]
    assert t["routed_cached_tokens"] == tier_blocks * BLOCK  # the router predicted the tier's hit ...
    assert t["kv_origin"] == {  # ... and the engine delivered it
        "engine": 0,
        "host_tier": tier_blocks * BLOCK,
        "peer": 0,
        "computed": usage["prompt_tokens"] - tier_blocks * BLOCK,
    }
    assert t["miss"]["undelivered"] == 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == tier_blocks * BLOCK


def test_a_session_s_context_is_pinned_in_the_tier_and_its_next_turn_demotes_the_old_tail(running: Running) -> None:
    tier = TierClient(running.endpoint, running.layout.fingerprint(), timeout_s=30)
    before = tier.stats()
    turn1 = "Session turn one: " + PROMPTS[2]
    body = {"model": running.model.name, "prompt": turn1, "max_tokens": 12, "temperature": 0}
    headers = {"x-session-id": "sess-tier-e2e"}
    resp = httpx.post(f"{running.url}/v1/completions", json=body, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    prompt_blocks = resp.json()["usage"]["prompt_tokens"] // BLOCK
    # the turn's blocks are offloaded and pinned as the session's, one engine step after it ends
    assert wait_for(lambda: tier.stats().pinned >= before.pinned + prompt_blocks, timeout_s=30), tier.stats()
    # the next turn shares the first half of the context and then diverges: the old tail is demoted
    turn2 = turn1[: len(turn1) // 2] + " and then the tool answered something else entirely " * 3
    resp = httpx.post(f"{running.url}/v1/completions", json={**body, "prompt": turn2}, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    assert wait_for(lambda: tier.stats().demoted > before.demoted, timeout_s=30), tier.stats()
    # a request without a session pins nothing
    quiet = tier.stats()
    running.routed("No session here: " + PROMPTS[3])
    assert wait_for(lambda: tier.stats().stored > quiet.stored, timeout_s=30)  # offloaded, not pinned
    assert tier.stats().pinned == quiet.pinned
