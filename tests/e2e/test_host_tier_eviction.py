"""A real engine with a small KV cache and the host tier: a block the engine evicts to reuse its memory is
saved to the tier before anything overwrites it (``HostTierConnector``: the scheduler half tells an
eviction from a block id handed out again, the worker half copies it in ``handle_preemptions``), and a
prompt served from those saved blocks gives the tokens its first computation gave (float32 greedy).

The tier's copy made when the request ended is forgotten first, so what serves the prompt at the end can
only be the copy taken at eviction: a save that read the block after the step wrote it would give other
tokens (its checksum is taken of what it read, so nothing else would catch it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from host_tier.client import TierClient
from tests.e2e.test_host_tier import BLOCK, REDIS_URL, Running
from tests.support.helpers import engine_healthy, wait_for

pytestmark = pytest.mark.e2e

PORT = 18600
ENGINE_BLOCKS = 40
"""1,280 tokens: the fillers below (~11 blocks each) push the first prompt out of the engine."""


def _prompt(tag: str) -> str:
    return " ".join(
        f"evict line {i} of {tag}: def handler_{tag}_{i}(request): return route(request, {i})" for i in range(12)
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    redis.Redis.from_url(REDIS_URL).flushdb()  # (test_host_tier's database: its modules run one after the other)
    small = ("--max-model-len", "1024", "--engine-arg", f"--num-gpu-blocks-override={ENGINE_BLOCKS}")
    e = Running(tmp_path_factory.mktemp("host-tier-eviction"), port=PORT, node_args=small)
    e.start()
    try:
        assert wait_for(lambda: engine_healthy(PORT), timeout_s=300), (e.tmp / "procs.log").read_text()[-3000:]
        yield e
    finally:
        e.stop()
        redis.Redis.from_url(REDIS_URL).flushdb()


def _held_keys(tier: TierClient) -> set[bytes]:
    return {rec.key for rec in tier.arena.scan()}


def test_an_evicted_block_is_saved_before_it_is_reused_and_serves_the_same_tokens(engine: Running) -> None:
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
