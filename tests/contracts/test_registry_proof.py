"""Registration proof against the real Redis: a router of cluster A lists a node only if its entry proves
A's secret bound to A's name; another cluster's secret, another cluster's name, a forged or edited entry
are refused."""

from __future__ import annotations

import secrets

import msgspec
import pytest
import redis.asyncio as aioredis

from contracts.registry import NodeInfo, NodeRegistry, Role, node_key, registry_proof_key

CLUSTER = "proof-a"


def _info(node_id: str) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=Role.BOTH,
        model="m",
        url="http://127.0.0.1:25100",
        block_size=16,
        max_model_len=2048,
        kv_connector="tandem",
        kv_endpoints={"tcp": "tcp://127.0.0.1:25103"},
    )


@pytest.fixture
async def client(redis_unit_url: str):
    c = aioredis.from_url(redis_unit_url)
    yield c
    await c.flushdb()
    await c.aclose()


async def test_only_nodes_proving_the_clusters_secret_are_listed(client: aioredis.Redis) -> None:
    secret_a, secret_b = secrets.token_hex(32).encode(), secrets.token_hex(32).encode()
    key_a = registry_proof_key(secret_a, CLUSTER)
    router = NodeRegistry(client, cluster=CLUSTER, proof_key=key_a)
    await NodeRegistry(client, cluster=CLUSTER, proof_key=key_a, ttl_s=60).register(_info("own"))
    # A's name, B's secret (B's default secret on loopback): refused.
    await NodeRegistry(client, cluster=CLUSTER, proof_key=registry_proof_key(secret_b, CLUSTER), ttl_s=60).register(
        _info("b-secret")
    )
    # A's secret proving another cluster's name: refused too (the key binds the name).
    await NodeRegistry(client, cluster=CLUSTER, proof_key=registry_proof_key(secret_a, "proof-b"), ttl_s=60).register(
        _info("b-name")
    )
    assert [n.info.node_id for n in await router.live_nodes()] == ["own"]
    assert router.skipped["unproven"] == 2
    # A reader without a proof key (tandem cluster status) still sees every entry of the cluster.
    assert len(await NodeRegistry(client, cluster=CLUSTER).live_nodes()) == 3


async def test_an_entry_edited_after_signing_is_refused(client: aioredis.Redis) -> None:
    key_a = registry_proof_key(secrets.token_hex(32).encode(), CLUSTER)
    router = NodeRegistry(client, cluster=CLUSTER, proof_key=key_a)
    await NodeRegistry(client, cluster=CLUSTER, proof_key=key_a, ttl_s=60).register(_info("n"))
    [listed] = await router.live_nodes()
    assert listed.info == _info("n")  # the proof is checked and dropped: readers get what the node wrote
    raw = await client.get(node_key("n", CLUSTER))
    signed = msgspec.msgpack.decode(raw, type=NodeInfo)
    moved = msgspec.structs.replace(signed, url="http://10.9.9.9:80")  # the proof of another address
    await client.set(node_key("n", CLUSTER), msgspec.msgpack.encode(moved))
    assert await router.live_nodes() == []


async def test_a_registration_is_verified_once_until_its_bytes_change(
    client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    import contracts.registry as registry

    key_a = registry_proof_key(secrets.token_hex(32).encode(), CLUSTER)
    router = NodeRegistry(client, cluster=CLUSTER, proof_key=key_a)
    node = NodeRegistry(client, cluster=CLUSTER, proof_key=key_a, ttl_s=60)
    await node.register(_info("n"))
    proofs: list[str] = []
    real = registry.registration_proof

    def counted(info: NodeInfo, key: bytes) -> str:
        proofs.append(info.node_id)
        return real(info, key)

    monkeypatch.setattr(registry, "registration_proof", counted)
    for _ in range(3):  # heartbeats rewrite the load entry only: the registration is checked once
        assert [n.info.epoch for n in await router.live_nodes()] == [0]
    assert proofs == ["n"]
    await node.register(msgspec.structs.replace(_info("n"), epoch=1))  # a new engine: new bytes, checked anew
    assert [n.info.epoch for n in await router.live_nodes()] == [1]
    assert proofs == ["n", "n", "n"]  # the writer's signature, then the reader's check
