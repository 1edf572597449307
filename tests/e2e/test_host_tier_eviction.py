"""A real engine with a small KV cache and the host tier: a block the engine evicts to reuse its memory is
saved to the tier before anything overwrites it (``HostTierConnector``: the scheduler half tells an
eviction from a block id handed out again, the worker half copies it in ``handle_preemptions``), and a
prompt served from those saved blocks gives the tokens its first computation gave (float32 greedy).

The tier's copy made when the request ended is forgotten first, so what serves the prompt at the end can
only be the copy taken at eviction: a save that read the block after the step wrote it would give other
tokens (its checksum is taken of what it read, so nothing else would catch it)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from host_tier.client import TierClient
from host_tier.settings import layout_from_model
from kv_transfer.auth import engine_auth_headers
from node_agent.model import default_model_dir
from tests.support.helpers import colocated_node_command, engine_healthy, tier_serve_command, wait_for

pytestmark = pytest.mark.e2e

REDIS_URL = os.environ.get(
    "TANDEM_TEST_REDIS_TIER", "redis://127.0.0.1:6379/10"
)  # as test_host_tier (run one after the other)
PORT = 18600
BLOCK = 32
ENGINE_BLOCKS = 40
"""1,280 tokens: the fillers below (~11 blocks each) push the first prompt out of the engine."""


def _prompt(tag: str) -> str:
    return " ".join(
        f"evict line {i} of {tag}: def handler_{tag}_{i}(request): return route(request, {i})" for i in range(12)
    )


class Engine:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = default_model_dir()
        self.layout = layout_from_model(self.model, "float32", BLOCK)
        self.endpoint = f"ipc://{tmp}/tier.sock"
        self.env = {
            **os.environ,
            "TANDEM_TIER_DIR": str(tmp),
            "TANDEM_TIER_ENDPOINT": self.endpoint,
            "TANDEM_TIER_EVENTS_ENDPOINT": f"ipc://{tmp}/tier-events.sock",
            "TANDEM_TIER_REPLAY_ENDPOINT": f"ipc://{tmp}/tier-replay.sock",
            "TANDEM_NODE_HOST_TIER_TIMEOUT_S": "30",  # a slow lookup on a busy host must not turn the tier off
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        log = (self.tmp / "procs.log").open("ab")
        tier = tier_serve_command(self.model, "float32", BLOCK, 256 * self.layout.block_bytes)
        node = colocated_node_command(
            PORT,
            f"evict-{PORT}",
            REDIS_URL,
            self.tmp,
            "--cores",
            "1",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "1024",
            "--engine-arg",
            f"--num-gpu-blocks-override={ENGINE_BLOCKS}",
            "--host-tier",
            self.endpoint,
        )
        for cmd in (tier, node):
            self.procs.append(
                subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(60)

    def complete(self, prompt: str) -> tuple[str, int]:
        resp = httpx.post(
            f"http://127.0.0.1:{PORT}/v1/completions",
            json={"model": self.model.name, "prompt": prompt, "max_tokens": 12, "temperature": 0},
            headers=engine_auth_headers(loopback_only=True),
            timeout=300,
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        details = body["usage"].get("prompt_tokens_details") or {}
        return body["choices"][0]["text"], int(details.get("cached_tokens") or 0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    redis.Redis.from_url(REDIS_URL).flushdb()
    e = Engine(tmp_path_factory.mktemp("host-tier-eviction"))
    e.start()
    try:
        assert wait_for(lambda: engine_healthy(PORT), timeout_s=300), (e.tmp / "procs.log").read_text()[-3000:]
        yield e
    finally:
        e.stop()
        redis.Redis.from_url(REDIS_URL).flushdb()


def _held_keys(tier: TierClient) -> set[bytes]:
    return {rec.key for rec in tier.arena.scan()}


def test_an_evicted_block_is_saved_before_it_is_reused_and_serves_the_same_tokens(engine: Engine) -> None:
    tier = TierClient(engine.endpoint, engine.layout.fingerprint(), timeout_s=30)
    first = _prompt("first")
    text0, cached0 = engine.complete(first)
    assert cached0 == 0
    assert wait_for(lambda: tier.stats().held > 0, timeout_s=30), tier.stats()
    own = _held_keys(tier)  # the first prompt's blocks, stored cold when its request ended
    tier.forget(sorted(own), reason="test")  # as if tier pressure had taken them
    assert tier.stats().held == 0
    for i in range(6):  # ~66 blocks through a 40-block cache: the first prompt's blocks are reused
        engine.complete(_prompt(f"filler-{i}"))
    # Its blocks are back, saved as the engine evicted them (its request's own offload was forgotten).
    assert wait_for(lambda: own <= _held_keys(tier), timeout_s=30), (len(own), len(own & _held_keys(tier)))
    hits = tier.stats().hits
    text1, cached1 = engine.complete(first)
    assert text1 == text0  # KV saved at eviction gives the tokens computed KV gave
    assert cached1 >= BLOCK and tier.stats().hits > hits  # loaded from the tier, not computed
