"""Fixtures shared by tests/router/admission and tests/router/sessions: real Redis (logical DBs 4 and 5, a unique key
prefix per test, deleted afterwards), real PostgreSQL (a schema per test in database ``tandem_test``,
dropped afterwards; a PostgreSQL that is down fails the test) and SQLite in a temporary folder."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest
import redis.asyncio as aioredis

from router.admission.context import AdmissionContext, AdmissionSettings

REDIS_A = "redis://127.0.0.1:6379/4"
REDIS_B = "redis://127.0.0.1:6379/5"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
PG_DB = "tandem_test"


class FakeClock:
    """Milliseconds, moved by hand: rate-limit tests do not wait for real time."""

    def __init__(self) -> None:
        self.ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.ms

    def advance(self, seconds: float) -> None:
        self.ms += round(seconds * 1000)


async def delete_prefix(url: str, prefix: str) -> None:
    r = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await r.delete(*keys)
    finally:
        await r.aclose()


async def wait_until(check: Callable[[], Awaitable[bool]] | Callable[[], bool], within_s: float = 30.0) -> None:
    """Poll ``check`` until true; fail after ``within_s`` seconds. The bound is generous: a condition that
    holds returns at once, and CI's loaded 2-core host once took more than 5 s to get a request through
    a router that had just started (tests/router/test_router_layerwise.py)."""
    end = time.monotonic() + within_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {within_s} s")
        await asyncio.sleep(0.005)


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:10]}:"


@pytest.fixture
async def redis_a(prefix: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(REDIS_A)
    yield r
    await r.aclose()
    await delete_prefix(REDIS_A, prefix)


@pytest.fixture
async def redis_b(prefix: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(REDIS_B)
    yield r
    await r.aclose()
    await delete_prefix(REDIS_B, prefix)


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    """A fresh schema in ``tandem_test``. PostgreSQL down → the test errors (never skips)."""
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", PG_DB):
            await admin.execute(f"CREATE DATABASE {PG_DB}")
    finally:
        await admin.close()
    schema = f"t_{uuid.uuid4().hex[:12]}"
    yield f"postgresql://postgres@127.0.0.1:5432/{PG_DB}?schema={schema}"
    conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:5432/{PG_DB}")
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/tandem.db"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_settings(prefix: str, db_url: str, redis_a, redis_b) -> Callable[..., AdmissionSettings]:
    """Settings for region ``a`` (Redis DB 4; region ``b`` is DB 5) over the test's database."""

    def make(**overrides: object) -> AdmissionSettings:
        values: dict[str, object] = {
            "redis_url": REDIS_A,
            "key_prefix": prefix,
            "database_url": db_url,
            "region": "a",
            "region_cache_urls": {"a": REDIS_A, "b": REDIS_B},
        }
        values.update(overrides)
        return AdmissionSettings(**values)  # type: ignore[arg-type]

    return make


@pytest.fixture
async def open_ctx(make_settings, clock) -> AsyncIterator[Callable[..., Awaitable[AdmissionContext]]]:
    """``await open_ctx(**setting_overrides)``: a context closed at the end of the test."""
    opened: list[AdmissionContext] = []

    async def open_(**overrides: object) -> AdmissionContext:
        ctx = await AdmissionContext.create(make_settings(**overrides), clock_ms=clock)
        opened.append(ctx)
        return ctx

    yield open_
    for ctx in opened:
        await ctx.close()


@pytest.fixture
async def ctx(open_ctx) -> AdmissionContext:
    return await open_ctx()
