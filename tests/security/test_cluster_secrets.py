"""A node started under cluster A's name but holding cluster B's secret (B's default secret on loopback,
where each cluster name has its own) is refused by A's router and by A's block server: its registry entry
does not prove A's secret, so A's routers leave it out, and its pulls are rejected at once, unread, by a
real block server (its own process, real tcp) that holds A's secret."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis

from contracts.cluster import CLUSTER_ENV
from contracts.registry import NodeInfo, NodeRegistry, Role, registry_proof_key
from contracts.secret import SECRET_ENV, SECRET_FILE_ENV, load_cluster_secret
from decode_nodes.puller import Puller, PullJob
from kv_transfer import wire
from kv_transfer.layout import KVLayout
from kv_transfer.stats import TransferStats
from tests.support.block_server_proc import BLOCKS, LAYERS, SHAPE, Remote

A, B = "secret-a", "secret-b"


@pytest.fixture
def defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, bytes]:
    """Each cluster's default secret on loopback, as its processes would create and read them."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    out = {}
    for name in (A, B):
        monkeypatch.setenv(CLUSTER_ENV, name)
        out[name] = load_cluster_secret(loopback_only=True)
    assert out[A] != out[B]
    return out


@pytest.fixture
def a_block_server(defaults: dict[str, bytes]) -> Iterator[Remote]:
    r = Remote(secret=defaults[A], faults=False)
    yield r
    r.close()


async def test_as_router_lists_only_nodes_proving_as_secret(defaults: dict[str, bytes], redis_unit_url: str) -> None:
    client = aioredis.from_url(redis_unit_url)
    try:
        router = NodeRegistry(client, cluster=A, proof_key=registry_proof_key(defaults[A], A))
        for node_id, secret in (("own", defaults[A]), ("b-secret", defaults[B])):
            info = NodeInfo(
                node_id=node_id,
                role=Role.BOTH,
                model="m",
                url="http://127.0.0.1:1",
                block_size=16,
                max_model_len=2048,
                kv_connector="tandem",
            )
            await NodeRegistry(client, cluster=A, proof_key=registry_proof_key(secret, A), ttl_s=60).register(info)
        assert [n.info.node_id for n in await router.live_nodes()] == ["own"]
        assert router.skipped["unproven"] == 1
    finally:
        await client.flushdb()
        await client.aclose()


def test_as_block_server_refuses_a_puller_holding_bs_secret(a_block_server: Remote, defaults: dict[str, bytes]) -> None:
    arrays = [np.zeros((BLOCKS, *SHAPE), np.float32) for _ in range(LAYERS)]
    layout = KVLayout.from_arrays(arrays)
    a_block_server.offer("cross", [1, 2])
    before = a_block_server.refusals()[0]
    puller = Puller(layout, TransferStats(), wire.Codec(defaults[B]))
    t0 = time.monotonic()
    try:
        ids = [1, 2]
        job = PullJob("cross", "cross", a_block_server.tcp, "tcp", wire.segments_of(ids, ids), ids, t0 + 30)
        puller.submit(job)
        out = puller.outcomes.get(timeout=40)
    finally:
        puller.close()
    assert not out.ok and "authentication" in out.reason
    assert time.monotonic() - t0 < 10, "waited out its deadline instead of being refused"
    assert a_block_server.refusals()[0] > before  # counted
    assert not any(a.any() for a in arrays)  # nothing was written into the puller's cache
    assert a_block_server.state("cross") == "held"  # and A's lease is untouched
