"""Redis is an untrusted store (issue 35, item 2): what someone who can write the cluster's Redis but does
not hold the cluster secret can do to authentication. A forged key record (any tenant, admin), an
edited one (a real key made admin) and ``keys:exist = 0`` while the store holds keys each change
nothing, and each is counted on ``tandem_store_rejected_total``. Real Redis and PostgreSQL/SQLite (the
admission fixtures of tests/router/admission/support.py)."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, generate_latest

from contracts.errors import AuthenticationFailed
from contracts.registry import NodeInfo, NodeRegistry, Role, registry_proof_key
from router.admission import AdmissionContext, Priority, hash_key
from router.admission.key_records import record_mac, record_mac_key
from router.admission.rejections import RejectedRecords
from tests.security.support import REDIS_URL, router

UNKNOWN_KEY = "tdm-deadbeef-" + "A" * 43


def _forged_fields(tenant: str, *, admin: bool) -> dict[str, str]:
    return {
        "t": tenant,
        "k": "deadbeef",
        "r": "0",
        "m": "0",
        "p": str(Priority.INTERACTIVE),
        "x": "0",
        "a": str(int(admin)),
    }


@pytest.mark.parametrize("mac", ["none", "garbage", "another secret"])
async def test_a_forged_key_record_authenticates_nobody(
    ctx: AdmissionContext, redis_a: aioredis.Redis, mac: str
) -> None:
    await ctx.keys.create_key("acme")  # auth on
    rkey = ctx.keys.record_key(hash_key(UNKNOWN_KEY))
    fields = _forged_fields("acme", admin=True)
    if mac == "garbage":
        fields["h"] = "0" * 64
    elif mac == "another secret":  # a well-formed HMAC, under a secret that is not the cluster's
        other = record_mac_key(secrets.token_hex(32).encode())
        fields["h"] = record_mac(other, hash_key(UNKNOWN_KEY), [fields[c] for c in "tkrmpxa"])
    await redis_a.hset(rkey, mapping=fields)

    for check in (ctx.gate.authenticate, ctx.gate.admit):
        with pytest.raises(AuthenticationFailed, match="invalid API key"):
            await check(f"Bearer {UNKNOWN_KEY}")
    assert ctx.keys.rejected["record"] == 1  # counted once: the forged record was replaced by the store's answer
    assert await redis_a.hget(rkey, "n") == b"1"  # the store's answer: no such key
    assert await redis_a.hget(rkey, "t") is None


async def test_a_real_key_edited_to_admin_stays_what_the_store_says(
    ctx: AdmissionContext, redis_a: aioredis.Redis
) -> None:
    info, key = await ctx.keys.create_key("acme", rpm=5)
    rkey = ctx.keys.record_key(hash_key(key))
    await redis_a.hset(rkey, mapping={"a": "1", "r": "0", "t": "other"})  # its valid h kept, fields edited

    tenant = (await ctx.gate.admit(f"Bearer {key}")).tenant
    assert (tenant.tenant_id, tenant.key_id, tenant.admin, tenant.rpm) == ("acme", info.key_id, False, 5)
    assert ctx.keys.rejected["record"] == 1
    assert await redis_a.hmget(rkey, "t", "a", "r") == [b"acme", b"0", b"5"]
    # and the restored record verifies: no further rejection
    assert (await ctx.gate.authenticate(f"Bearer {key}")).tenant_id == "acme"
    assert ctx.keys.rejected["record"] == 1


async def test_keys_exist_zero_does_not_turn_auth_off(open_ctx, redis_a: aioredis.Redis) -> None:
    creator = await open_ctx()
    await creator.keys.create_key("acme")
    router = await open_ctx()  # a router that has not seen a key yet: it only has Redis's word
    await redis_a.set(router.keys.flag_key, "0")

    with pytest.raises(AuthenticationFailed, match="missing API key"):
        await router.gate.admit(None)
    assert router.keys.rejected["flag"] == 1
    assert await redis_a.get(router.keys.flag_key) == b"1"  # overwritten with the store's answer

    # fails closed for good: once a key was seen, a "0" is not even read (no store query, no count)
    for _ in range(3):
        await redis_a.set(router.keys.flag_key, "0")
        with pytest.raises(AuthenticationFailed, match="missing API key"):
            await router.gate.authenticate(None)
        with pytest.raises(AuthenticationFailed, match="invalid API key"):
            await router.gate.admit(f"Bearer {UNKNOWN_KEY}")
    assert router.keys.rejected["flag"] == 1


async def test_auth_stays_off_while_the_store_holds_no_key(ctx: AdmissionContext, redis_a: aioredis.Redis) -> None:
    """The check does not refuse an honest "0": a cluster without keys serves anonymously, uncounted."""
    for _ in range(3):
        assert (await ctx.gate.admit(None)).tenant.tenant_id == "anonymous"
    assert await redis_a.get(ctx.keys.flag_key) == b"0"
    assert sum(ctx.keys.rejected.values()) == 0


async def test_rejections_are_on_the_metrics(ctx: AdmissionContext, redis_a: aioredis.Redis) -> None:
    await ctx.keys.create_key("acme")
    await redis_a.hset(ctx.keys.record_key(hash_key(UNKNOWN_KEY)), mapping=_forged_fields("acme", admin=True))
    with pytest.raises(AuthenticationFailed):
        await ctx.gate.authenticate(f"Bearer {UNKNOWN_KEY}")
    cluster = f"sec-{secrets.token_hex(4)}"
    nodes = NodeRegistry(redis_a, cluster=cluster, proof_key=registry_proof_key(b"r" * 32, cluster))
    forger = NodeRegistry(redis_a, cluster=cluster, proof_key=registry_proof_key(b"f" * 32, cluster), ttl_s=30)
    await forger.register(
        NodeInfo(
            node_id="forged",
            role=Role.BOTH,
            model="m",
            url="http://127.0.0.1:1",
            block_size=16,
            max_model_len=2048,
            kv_connector="tandem",
        )
    )
    try:
        assert await nodes.live_nodes() == []
        registry = CollectorRegistry()
        registry.register(RejectedRecords(lambda: ctx.keys.rejected, lambda: dict(nodes.skipped)))
        text = generate_latest(registry).decode()
        assert 'tandem_store_rejected_total{kind="key_record"} 1.0' in text
        assert 'tandem_store_rejected_total{kind="auth_flag"} 0.0' in text
        assert 'tandem_store_rejected_total{kind="registry_unproven"} 1.0' in text
    finally:
        await forger.deregister("forged")


async def test_a_routers_metrics_count_a_forged_record(tmp_path: Path) -> None:
    async with router(tmp_path, engine=False) as r, httpx.AsyncClient(base_url=r.url, timeout=30) as client:
        admin = await r.create_key("ops", admin=True)
        forged = aioredis.Redis.from_url(REDIS_URL)
        try:
            rkey = f"{r.admission.key_prefix}key:{hash_key(UNKNOWN_KEY)}"
            await forged.hset(rkey, mapping=_forged_fields("ops", admin=True))
        finally:
            await forged.aclose()
        refused = await client.get("/metrics", headers={"Authorization": f"Bearer {UNKNOWN_KEY}"})
        assert refused.status_code == 401
        text = (await client.get("/metrics", headers=admin)).text
        assert 'tandem_store_rejected_total{kind="key_record"} 1.0' in text
