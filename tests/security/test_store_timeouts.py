"""Every call of the data path to a store is bounded (issue 13, item 5): a PostgreSQL that hangs (a
server that accepts connections and never answers, or a statement that runs past its timeout) fails
the caller with ``StoreTimeout`` within a known time, and a hung Redis makes a session read fall back
to the store instead of holding the request. Real PostgreSQL and Redis; the hung servers are real
listening sockets that never answer."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import redis.exceptions

from contracts.errors import StoreError, StoreTimeout
from router.admission.context import AdmissionContext, AdmissionSettings
from router.sessions.sql import open_database
from router.sessions.store import RegionCache, SessionStore

TIMEOUT_S = 0.5
SLACK_S = 3.0
"""What the test allows beyond the timeout (a loaded two-core machine): far below the 60 s+ that
asyncpg and redis-py would wait by default, or forever."""


@pytest.fixture
def hung_port() -> Iterator[int]:
    """A TCP port whose server never answers: the kernel completes each handshake into the backlog,
    nobody ever reads or writes."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as srv:
        yield srv.getsockname()[1]


async def test_a_postgresql_that_never_answers_times_out_at_connect(hung_port: int) -> None:
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="did not answer within 0.5 s"):
        await open_database(
            f"postgresql://postgres@127.0.0.1:{hung_port}/tandem_test",
            connect_timeout_s=TIMEOUT_S,
            command_timeout_s=TIMEOUT_S,
        )
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S


async def test_a_statement_past_its_timeout_is_cancelled_and_the_pool_still_serves(pg_url: str) -> None:
    db = await open_database(pg_url, command_timeout_s=TIMEOUT_S, connect_timeout_s=5.0)
    try:
        for call in (
            lambda: db.fetch("SELECT pg_sleep(30)"),
            lambda: db.execute("SELECT pg_sleep(30)"),
            lambda: db.execute_many("SELECT pg_sleep($1)", [(30.0,)]),
        ):
            t0 = time.monotonic()
            with pytest.raises(StoreTimeout) as info:
                await call()
            assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
            assert isinstance(info.value, StoreError)  # callers that handle StoreError handle this too
        assert await db.fetch("SELECT 1") == [(1,)]
    finally:
        await db.close()


async def test_the_router_context_bounds_postgresql_with_its_settings(hung_port: int) -> None:
    settings = AdmissionSettings(
        database_url=f"postgresql://postgres@127.0.0.1:{hung_port}/x",
        database_connect_timeout_s=TIMEOUT_S,
        database_command_timeout_s=TIMEOUT_S,
    )
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout):
        await AdmissionContext.create(settings, start_writer=False)
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S


async def test_a_hung_redis_times_out_and_a_session_read_falls_back_to_the_store(
    hung_port: int, pg_url: str, prefix: str
) -> None:
    settings = AdmissionSettings(
        redis_url=f"redis://127.0.0.1:{hung_port}/0",
        database_url=pg_url,
        key_prefix=prefix,
        redis_socket_timeout_s=TIMEOUT_S,
        redis_connect_timeout_s=TIMEOUT_S,
    )
    ctx = await AdmissionContext.create(settings, start_writer=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            await ctx.redis.ping()
        assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
        store = SessionStore(ctx.db, RegionCache("hung", ctx.redis), prefix=prefix)
        await store.init_schema()
        t0 = time.monotonic()
        assert await store.get_history("tenant", "session-1") == []  # from the store, Redis given up on
        assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
    finally:
        await ctx.close()
