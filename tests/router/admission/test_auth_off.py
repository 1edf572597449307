"""The admission fast path while auth is off (``router.admission.auth_off``): once Redis and the store
have confirmed auth off, requests are admitted without a round trip for up to the lease; a key created
in this process, or announced by another one over Redis, ends the lease at once; nothing is reused while
the subscription is not live, once the lease has run out, or while a limit applies to anonymous
requests. Real Redis and both stores (tests/router/admission/support.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from contracts.errors import AuthenticationFailed
from router.admission.auth_off import keys_changed_channel
from router.admission.context import AdmissionContext
from tests.router.admission.support import wait_until


def _round_trips(ctx: AdmissionContext) -> Callable[[], int]:
    """How many admissions asked Redis (the admission script's calls) from now on."""
    calls = 0
    script = ctx.gate._admit

    async def counted(**kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return await script(**kwargs)

    ctx.gate._admit = counted  # type: ignore[method-assign]
    return lambda: calls


async def _listening(ctx: AdmissionContext) -> AdmissionContext:
    ctx.keys.auth_off.listen(ctx.redis)
    await wait_until(lambda: ctx.keys.auth_off.live)
    return ctx


async def test_auth_off_is_asked_once_per_lease(open_ctx) -> None:
    ctx = await _listening(await open_ctx())
    trips = _round_trips(ctx)
    await ctx.gate.admit(None)  # Redis (and, the flag being new, the store) say auth is off
    asked = trips()
    tenants = [(await ctx.gate.admit(None, prompt_tokens=10)).tenant for _ in range(5)]
    assert {t.tenant_id for t in tenants} == {"anonymous"} and trips() == asked
    now = [0.0]
    ctx.keys.auth_off._clock = lambda: now[0]
    ctx.keys.auth_off.grant(ctx.keys.auth_off.epoch)
    now[0] += ctx.keys.auth_off.lease_s  # the lease has run out: Redis is asked again, once
    await ctx.gate.admit(None)
    await ctx.gate.admit(None)
    assert trips() == asked + 1


async def test_a_key_created_here_ends_the_lease_before_create_key_returns(open_ctx) -> None:
    ctx = await _listening(await open_ctx())
    await ctx.gate.admit(None)
    assert ctx.keys.auth_off.valid()
    await ctx.keys.create_key("team-a")
    with pytest.raises(AuthenticationFailed):
        await ctx.gate.admit(None)


async def test_a_key_announced_over_redis_ends_the_lease(open_ctx, redis_a: aioredis.Redis, prefix: str) -> None:
    ctx = await _listening(await open_ctx())
    listener = redis_a.pubsub()
    await listener.subscribe(keys_changed_channel(prefix))
    await ctx.gate.admit(None)
    assert ctx.keys.auth_off.valid()
    # What create_key in another process sends after it wrote the flag.
    await redis_a.publish(keys_changed_channel(prefix), "k1")
    await wait_until(lambda: not ctx.keys.auth_off.valid())
    assert ctx.keys.auth_off.ended == 1
    # And create_key does send it.
    other = await open_ctx()
    _, key = await other.keys.create_key("team-b")
    messages = [await listener.get_message(timeout=5) for _ in range(3)]
    assert any(m and m["type"] == "message" for m in messages)
    with pytest.raises(AuthenticationFailed):
        await ctx.gate.admit(None)
    assert (await ctx.gate.admit(f"Bearer {key}")).tenant.tenant_id == "team-b"
    await listener.aclose()


async def test_every_request_asks_redis_while_not_listening_or_limited(open_ctx) -> None:
    quiet = await open_ctx()  # no subscription: a key created elsewhere could not be told here
    await quiet.gate.admit(None)
    trips = _round_trips(quiet)
    for _ in range(3):
        await quiet.gate.admit(None)
    assert trips() == 3 and not quiet.keys.auth_off.valid()
    for overrides in ({"auth_off_lease_s": 0}, {"global_tpm": 10_000}):
        asking = await _listening(await open_ctx(**overrides))
        await asking.gate.admit(None)
        trips = _round_trips(asking)
        for _ in range(3):
            await asking.gate.admit(None)
        assert trips() == 3, overrides
    limited = await _listening(await open_ctx(anonymous_rpm=1000))
    await limited.gate.admit(None)
    trips = _round_trips(limited)
    for _ in range(3):
        await limited.gate.admit(None)
    assert trips() == 3
    await limited.close()
    assert not limited.keys.auth_off.live and not limited.keys.auth_off.valid()


async def test_an_answer_asked_before_a_key_was_announced_grants_no_lease(open_ctx) -> None:
    ctx = await _listening(await open_ctx())
    lease = ctx.keys.auth_off
    asked_at = lease.epoch  # the admission script is on its way...
    lease.end()  # ...when a key's announcement arrives; then its "auth off" answer comes back
    lease.grant(asked_at)
    assert not lease.valid()
    lease.grant(lease.epoch)
    assert lease.valid()
