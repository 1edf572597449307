"""API keys: creation, hashing, authentication, revocation, auth on/off, survival of a Redis loss."""

from __future__ import annotations

import pytest

from contracts.errors import AuthenticationFailed, InvalidRequest, NotFound
from router.admission import Priority, hash_key
from router.admission.key_records import bearer_token
from router.admission.keys import ANONYMOUS_TENANT
from tests.router.admission.support import REDIS_A, delete_prefix


async def test_created_key_authenticates_and_is_stored_only_hashed(ctx, redis_a):
    info, key = await ctx.keys.create_key("acme", rpm=10, tpm=5000, priority=Priority.BATCH)
    assert key.startswith(f"tdm-{info.key_id}-")

    tenant = await ctx.gate.authenticate(f"Bearer {key}")
    assert (tenant.tenant_id, tenant.rpm, tenant.tpm, tenant.priority) == ("acme", 10, 5000, Priority.BATCH)
    assert tenant.key_id == info.key_id

    rows = await ctx.db.fetch("SELECT * FROM tandem_api_keys")
    assert len(rows) == 1
    assert hash_key(key) in rows[0]
    assert not any(key in str(col) for col in rows[0])
    secret = key[13:]
    for rkey in [k async for k in redis_a.scan_iter(match=f"{ctx.keys.prefix}*")]:
        assert secret.encode() not in rkey
        if await redis_a.type(rkey) == b"hash":
            assert not any(secret.encode() in v for v in (await redis_a.hgetall(rkey)).values())


async def test_auth_is_off_until_the_first_key_exists(ctx):
    anon = await ctx.gate.authenticate(None)
    assert anon.tenant_id == ANONYMOUS_TENANT
    await ctx.keys.create_key("acme")
    with pytest.raises(AuthenticationFailed, match="missing API key"):
        await ctx.gate.authenticate(None)
    with pytest.raises(AuthenticationFailed, match="invalid API key"):
        await ctx.gate.authenticate("Bearer tdm-00000000-" + "A" * 43)
    with pytest.raises(AuthenticationFailed, match="invalid API key"):
        await ctx.gate.authenticate("Bearer not-a-key")
    with pytest.raises(AuthenticationFailed):
        await ctx.gate.authenticate("Basic dXNlcjpwYXNz")


async def test_required_mode_rejects_requests_even_without_keys(open_ctx):
    ctx = await open_ctx(auth="required")
    with pytest.raises(AuthenticationFailed):
        await ctx.gate.authenticate(None)


async def test_revoked_key_is_rejected_and_auth_stays_on(ctx):
    info, key = await ctx.keys.create_key("acme")
    await ctx.gate.authenticate(f"Bearer {key}")
    revoked = await ctx.keys.revoke(info.key_id)
    assert revoked.revoked
    with pytest.raises(AuthenticationFailed, match="revoked") as err:
        await ctx.gate.authenticate(f"Bearer {key}")
    assert err.value.status_code == 401
    # the only key is revoked, yet auth stays on: no anonymous access
    with pytest.raises(AuthenticationFailed, match="missing"):
        await ctx.gate.authenticate(None)
    with pytest.raises(NotFound):
        await ctx.keys.revoke("deadbeef")


async def test_keys_and_revocations_survive_losing_redis(ctx, prefix):
    _, good = await ctx.keys.create_key("acme", rpm=7)
    bad_info, bad = await ctx.keys.create_key("acme")
    await ctx.keys.revoke(bad_info.key_id)
    await delete_prefix(REDIS_A, prefix)  # the region's Redis lost everything

    with pytest.raises(AuthenticationFailed, match="missing"):
        await ctx.gate.authenticate(None)  # flag re-derived from the store: auth still on
    tenant = await ctx.gate.authenticate(f"Bearer {good}")
    assert (tenant.tenant_id, tenant.rpm) == ("acme", 7)
    with pytest.raises(AuthenticationFailed, match="revoked"):
        await ctx.gate.authenticate(f"Bearer {bad}")


async def test_unknown_key_is_remembered_as_unknown_for_a_while(ctx, redis_a):
    await ctx.keys.create_key("acme")
    unknown = "tdm-00000000-" + "B" * 43
    with pytest.raises(AuthenticationFailed):
        await ctx.gate.authenticate(f"Bearer {unknown}")
    rkey = ctx.keys.record_key(hash_key(unknown))
    assert await redis_a.hget(rkey, "n") == b"1"
    assert 0 < await redis_a.pttl(rkey) <= 10_000


async def test_new_key_for_existing_tenant_updates_limits_of_all_its_keys(ctx):
    _, first = await ctx.keys.create_key("acme", rpm=5)
    await ctx.gate.authenticate(f"Bearer {first}")
    await ctx.keys.create_key("acme", rpm=50)
    assert (await ctx.gate.authenticate(f"Bearer {first}")).rpm == 50
    listed = await ctx.keys.list_keys("acme")
    assert [k.rpm for k in listed] == [50, 50]


async def test_bad_tenant_ids_and_limits_are_refused(ctx):
    with pytest.raises(InvalidRequest):
        await ctx.keys.create_key("has space")
    with pytest.raises(InvalidRequest):
        await ctx.keys.create_key(ANONYMOUS_TENANT)
    with pytest.raises(InvalidRequest):
        await ctx.keys.create_key("acme", rpm=-1)


def test_bearer_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Bearer ") is None
    assert bearer_token("Token abc") is None
    assert bearer_token(None) is None
