"""Token-bucket limits: requests/min and tokens/min, tenant and global layers, settle, retry_after."""

from __future__ import annotations

import asyncio

import pytest

from contracts.errors import RateLimited
from router.admission import Priority


@pytest.fixture
def db_url(tmp_path) -> str:  # limits live in Redis; one store backend is enough here
    return f"sqlite:///{tmp_path}/tandem.db"


async def _key(ctx, tenant: str, **limits) -> str:
    _, key = await ctx.keys.create_key(tenant, **limits)
    return f"Bearer {key}"


async def test_requests_per_minute_limit_and_exact_retry_after(ctx, clock):
    auth = await _key(ctx, "acme", rpm=3, tpm=0)
    for _ in range(3):
        await ctx.gate.admit(auth)
    with pytest.raises(RateLimited, match="tenant requests-per-minute limit 3") as err:
        await ctx.gate.admit(auth)
    assert err.value.retry_after == pytest.approx(20.0)  # one request refills in 60/3 s
    assert err.value.status_code == 429
    clock.advance(19.9)
    with pytest.raises(RateLimited) as err:
        await ctx.gate.admit(auth)
    assert err.value.retry_after == pytest.approx(0.1, abs=0.002)
    clock.advance(0.1)
    await ctx.gate.admit(auth)


async def test_tokens_per_minute_counts_prompt_plus_max_tokens(ctx, clock):
    auth = await _key(ctx, "acme", rpm=0, tpm=1000)
    await ctx.gate.admit(auth, prompt_tokens=400, max_tokens=100)
    await ctx.gate.admit(auth, prompt_tokens=400, max_tokens=100)
    with pytest.raises(RateLimited, match="tenant tokens-per-minute") as err:
        await ctx.gate.admit(auth, prompt_tokens=400, max_tokens=100)
    assert err.value.retry_after == pytest.approx(30.0)  # 500 tokens at 1000/min
    clock.advance(30)
    await ctx.gate.admit(auth, prompt_tokens=400, max_tokens=100)


async def test_settle_refunds_the_unused_reservation(ctx):
    auth = await _key(ctx, "acme", rpm=0, tpm=1000)
    first = await ctx.gate.admit(auth, prompt_tokens=400, max_tokens=500)
    with pytest.raises(RateLimited):
        await ctx.gate.admit(auth, prompt_tokens=400, max_tokens=100)
    await ctx.gate.settle(first, completion_tokens=100)  # 400 of the 500 reserved come back
    await ctx.gate.settle(first, completion_tokens=100)  # idempotent: no second refund
    await ctx.gate.admit(auth, prompt_tokens=400, max_tokens=100)
    with pytest.raises(RateLimited):
        await ctx.gate.admit(auth, prompt_tokens=1, max_tokens=0)


async def test_settle_charges_a_completion_longer_than_reserved(ctx, clock):
    auth = await _key(ctx, "acme", rpm=0, tpm=1200)
    adm = await ctx.gate.admit(auth, prompt_tokens=100)  # no max_tokens: reserves 256
    assert adm.reserved_completion_tokens == 256
    await ctx.gate.settle(adm, completion_tokens=1256)  # 1000 more than reserved: bucket at -156
    with pytest.raises(RateLimited) as err:
        await ctx.gate.admit(auth, prompt_tokens=50, max_tokens=0)
    assert err.value.retry_after == pytest.approx((156 + 50) / 20.0)  # 1200/min = 20 tokens/s


async def test_charge_tokens_after_tokenizing(ctx):
    auth = await _key(ctx, "acme", rpm=10, tpm=1000)
    adm = await ctx.gate.admit(auth)
    await ctx.gate.charge_tokens(adm, prompt_tokens=700, max_tokens=200)
    adm2 = await ctx.gate.admit(auth)
    with pytest.raises(RateLimited):
        await ctx.gate.charge_tokens(adm2, prompt_tokens=200, max_tokens=0)
    await ctx.gate.settle(adm, completion_tokens=0)
    await ctx.gate.charge_tokens(adm2, prompt_tokens=200, max_tokens=0)


async def test_a_rejected_request_charges_nothing(ctx):
    auth = await _key(ctx, "acme", rpm=2, tpm=100)
    await ctx.gate.admit(auth, prompt_tokens=60, max_tokens=0)
    with pytest.raises(RateLimited, match="tokens"):
        await ctx.gate.admit(auth, prompt_tokens=50, max_tokens=0)
    # had the rejected request been charged, this one would fail on requests/min or tokens/min
    await ctx.gate.admit(auth, prompt_tokens=40, max_tokens=0)
    with pytest.raises(RateLimited, match="requests"):
        await ctx.gate.admit(auth, prompt_tokens=0, max_tokens=0)


async def test_a_request_larger_than_the_limit_needs_a_full_bucket_then_leaves_debt(ctx, clock):
    auth = await _key(ctx, "acme", rpm=0, tpm=600)
    await ctx.gate.admit(auth, prompt_tokens=900, max_tokens=0)  # full bucket: allowed, 300 in debt
    with pytest.raises(RateLimited) as err:
        await ctx.gate.admit(auth, prompt_tokens=10, max_tokens=0)
    assert err.value.retry_after == pytest.approx(31.0)  # (300 + 10) tokens at 10/s


async def test_global_request_limit_spans_tenants(open_ctx):
    ctx = await open_ctx(global_rpm=2)
    a = await _key(ctx, "a", rpm=0, tpm=0)
    b = await _key(ctx, "b", rpm=0, tpm=0)
    await ctx.gate.admit(a)
    await ctx.gate.admit(b)
    with pytest.raises(RateLimited, match="global requests-per-minute limit 2") as err:
        await ctx.gate.admit(b)
    assert err.value.retry_after == pytest.approx(30.0)


async def test_global_token_limit_spans_tenants(open_ctx):
    ctx = await open_ctx(global_tpm=1000)
    a = await _key(ctx, "a", rpm=0, tpm=0)
    b = await _key(ctx, "b", rpm=0, tpm=0)
    await ctx.gate.admit(a, prompt_tokens=600, max_tokens=0)
    with pytest.raises(RateLimited, match="global tokens-per-minute"):
        await ctx.gate.admit(b, prompt_tokens=600, max_tokens=0)
    await ctx.gate.admit(b, prompt_tokens=400, max_tokens=0)


async def test_tenants_do_not_share_buckets(ctx):
    a = await _key(ctx, "a", rpm=1, tpm=0)
    b = await _key(ctx, "b", rpm=1, tpm=0)
    await ctx.gate.admit(a)
    await ctx.gate.admit(b)
    with pytest.raises(RateLimited):
        await ctx.gate.admit(a)


async def test_anonymous_limits_apply_while_auth_is_off(open_ctx):
    ctx = await open_ctx(anonymous_rpm=1)
    adm = await ctx.gate.admit(None)
    assert adm.tenant.tenant_id == "anonymous"
    with pytest.raises(RateLimited):
        await ctx.gate.admit(None)


async def test_priority_comes_from_the_tenant_and_the_header_can_only_lower_it(ctx):
    inter = await _key(ctx, "inter", rpm=0, tpm=0)
    batch = await _key(ctx, "batch", rpm=0, tpm=0, priority=Priority.BATCH)
    assert (await ctx.gate.admit(inter)).priority is Priority.INTERACTIVE
    assert (await ctx.gate.admit(inter, priority_header="batch")).priority is Priority.BATCH
    assert (await ctx.gate.admit(batch, priority_header="interactive")).priority is Priority.BATCH


async def test_redis_clock_is_used_when_no_clock_is_injected(open_ctx, ctx, make_settings):
    from router.admission.context import AdmissionContext

    real = await AdmissionContext.create(make_settings(), clock_ms=None)
    try:
        auth = await _key(real, "acme", rpm=1, tpm=0)
        await real.gate.admit(auth)
        with pytest.raises(RateLimited) as err:
            await real.gate.admit(auth)
        assert 55.0 < err.value.retry_after <= 60.0
    finally:
        await real.close()


async def test_concurrent_admissions_never_exceed_the_limit(ctx):
    auth = await _key(ctx, "acme", rpm=5, tpm=0)
    results = await asyncio.gather(*(ctx.gate.admit(auth) for _ in range(20)), return_exceptions=True)
    assert sum(not isinstance(r, BaseException) for r in results) == 5
    assert all(isinstance(r, RateLimited) for r in results if isinstance(r, BaseException))
