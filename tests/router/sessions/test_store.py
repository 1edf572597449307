"""Session history over real Redis (regions a = DB 4, b = DB 5) and PostgreSQL / SQLite."""

from __future__ import annotations

import redis.asyncio as aioredis

from contracts.errors import StoreError
from router.sessions import FunctionCall, Message, RegionCache, SessionStore, ToolCall, Turn, Usage
from router.sessions.models import new_messages
from router.sessions.store import MARKER
from tests.router.admission.support import REDIS_A, delete_prefix

TENANT = "acme"


def turn(session: str, turn_id: str, n: int, *, text: str | None = None) -> Turn:
    """A tool-using turn: the user asks, the assistant calls a tool (odd n) or answers (even n)."""
    if n % 2:
        msgs = [Message(role="user", content=text or f"question {n}")]
        response = Message(
            role="assistant",
            tool_calls=[ToolCall(id=f"call_{n}", function=FunctionCall(name="read_file", arguments='{"p":"a.py"}'))],
        )
    else:
        msgs = [Message(role="tool", tool_call_id=f"call_{n - 1}", content=text or "print('hi')")]
        response = Message(role="assistant", content=f"answer {n}")
    return Turn(
        turn_id=turn_id,
        session_id=session,
        tenant_id=TENANT,
        created_at=1_700_000_000.0 + n,
        messages=msgs,
        response=response,
        usage=Usage(prompt_tokens=10 * n, completion_tokens=n, total_tokens=11 * n),
        model="smollm2",
    )


async def test_turns_are_written_off_the_fast_path_and_read_back_in_order(ctx):
    store = ctx.sessions
    turns = [turn("s1", f"t{n}", n) for n in (1, 2, 3, 4)]
    for t in reversed(turns):  # written in any order, read by created_at
        assert store.record_turn(t) is True
    await store.flush()
    history = await store.get_history(TENANT, "s1")
    assert history == turns
    assert history[0].tool_calls[0].function.name == "read_file"
    assert history[1].tool_results[0].tool_call_id == "call_1"
    assert store.stats.written == 4 and store.stats.dropped == 0


async def test_a_retried_turn_id_is_stored_once(ctx):
    store = ctx.sessions
    first = turn("s1", "t1", 1)
    store.record_turn(first)
    await store.flush()
    store.record_turn(first)  # the router retried after a timeout
    store.record_turn(turn("s1", "t1", 1, text="a different body, same id"))
    await store.flush()
    assert await store.get_history(TENANT, "s1") == [first]
    assert await store.read_store(TENANT, "s1") == [first]
    rows = await ctx.db.fetch("SELECT COUNT(*) FROM tandem_turns WHERE session_id = 's1'")
    assert rows[0][0] == 1


async def test_history_survives_a_router_restart(ctx, open_ctx, prefix):
    turns = [turn("s1", f"t{n}", n) for n in (1, 2)]
    for t in turns:
        ctx.sessions.record_turn(t)
    await ctx.close()  # drains the writer
    again = await open_ctx()  # new objects over the same Redis and database
    assert await again.sessions.get_history(TENANT, "s1") == turns
    await delete_prefix(REDIS_A, prefix)  # and even with the region's cache gone
    assert await again.sessions.get_history(TENANT, "s1") == turns


async def test_failover_reads_from_the_store_and_refills_the_other_region(open_ctx, redis_a, redis_b):
    region_a = await open_ctx(region="a")
    region_b = await open_ctx(region="b")
    key = region_a.sessions.cache_key(TENANT, "s1")
    turns = [turn("s1", f"t{n}", n) for n in (1, 2)]
    for t in turns:
        region_a.sessions.record_turn(t)
    await region_a.sessions.flush()
    assert await region_a.sessions.get_history(TENANT, "s1") == turns
    assert await redis_a.hexists(key, MARKER)
    assert not await redis_b.exists(key)  # region b never saw the session

    assert await region_b.sessions.get_history(TENANT, "s1") == turns  # from the store
    assert await redis_b.hexists(key, MARKER)  # ... and refilled into b's cache
    assert await redis_b.hlen(key) == 3

    # the session continues in b; a's cache holds it, so the new turn is replicated there too
    t3 = turn("s1", "t3", 3)
    region_b.sessions.record_turn(t3)
    await region_b.sessions.flush()
    assert await redis_a.hexists(key, "t3")
    assert await region_a.sessions.get_history(TENANT, "s1") == [*turns, t3]
    assert await region_b.sessions.get_history(TENANT, "s1") == [*turns, t3]


async def test_a_cached_empty_session_picks_up_new_turns(ctx):
    assert await ctx.sessions.get_history(TENANT, "fresh") == []  # miss: caches "empty"
    t1 = turn("fresh", "t1", 1)
    ctx.sessions.record_turn(t1)
    await ctx.sessions.flush()
    assert await ctx.sessions.get_history(TENANT, "fresh") == [t1]


async def test_delete_removes_the_session_everywhere(open_ctx, redis_a, redis_b):
    region_a = await open_ctx(region="a")
    region_b = await open_ctx(region="b")
    key = region_a.sessions.cache_key(TENANT, "s1")
    region_a.sessions.record_turn(turn("s1", "t1", 1))
    await region_a.sessions.flush()
    await region_a.sessions.get_history(TENANT, "s1")
    await region_b.sessions.get_history(TENANT, "s1")
    assert await redis_a.exists(key) and await redis_b.exists(key)

    assert await region_b.sessions.delete(TENANT, "s1") is True
    assert not await redis_a.exists(key) and not await redis_b.exists(key)
    assert await region_a.sessions.read_store(TENANT, "s1") == []
    assert await region_a.sessions.get_history(TENANT, "s1") == []
    assert await region_a.sessions.delete(TENANT, "nothing-here") is False


async def test_sessions_are_namespaced_by_tenant(ctx):
    ctx.sessions.record_turn(turn("s1", "t1", 1))
    await ctx.sessions.flush()
    assert await ctx.sessions.get_history("someone-else", "s1") == []


async def test_assemble_prompt_prepends_the_stored_conversation(ctx):
    for t in (turn("s1", "t1", 1), turn("s1", "t2", 2)):
        ctx.sessions.record_turn(t)
    await ctx.sessions.flush()
    new = [Message(role="user", content="and now?")]
    prompt = await ctx.sessions.assemble_prompt(TENANT, "s1", new)
    assert [m.role for m in prompt] == ["user", "assistant", "tool", "assistant", "user"]
    assert prompt[-1] == new[0]
    assert prompt[1].tool_calls is not None and prompt[2].tool_call_id == "call_1"


async def test_record_turn_never_blocks_and_counts_drops(ctx, redis_a):
    store = SessionStore(ctx.db, RegionCache("a", redis_a), prefix=ctx.settings.key_prefix, queue_size=2)
    try:
        results = [store.record_turn(turn("s9", f"t{n}", n)) for n in (1, 2, 3)]  # no await in between
        assert results == [True, True, False]
        assert store.stats.dropped == 1
        await store.flush()
        assert [t.turn_id for t in await store.get_history(TENANT, "s9")] == ["t1", "t2"]
    finally:
        await store.close()


async def test_a_dead_region_cache_falls_back_to_the_store(ctx):
    dead = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    store = SessionStore(ctx.db, RegionCache("dead", dead), prefix=ctx.settings.key_prefix)
    try:
        t1 = turn("s1", "t1", 1)
        store.record_turn(t1)
        await store.flush()
        assert store.stats.written == 1 and store.stats.cache_errors == 1
        assert await store.get_history(TENANT, "s1") == [t1]
    finally:
        await store.close()
        await dead.aclose()


async def test_long_sessions_are_served_from_the_store_not_cached(open_ctx, redis_a):
    ctx = await open_ctx(session_max_cached_turns=2)
    turns = [turn("long", f"t{n}", n) for n in (1, 2, 3)]
    for t in turns:
        ctx.sessions.record_turn(t)
    await ctx.sessions.flush()
    assert await ctx.sessions.get_history(TENANT, "long") == turns
    assert not await redis_a.hexists(ctx.sessions.cache_key(TENANT, "long"), MARKER)


def test_new_messages_finds_what_a_full_history_request_adds():
    hist = [Message(role="user", content="a"), Message(role="assistant", content="b")]
    new = Message(role="user", content="c")
    assert new_messages(hist, [*hist, new]) == [new]
    rewritten = [Message(role="user", content="summary"), new]
    assert new_messages(hist, rewritten) == rewritten
    assert new_messages([], [new]) == [new]


class FlakyDatabase:
    """The real database, whose batch writes fail the first ``failures`` times."""

    def __init__(self, db, failures: int) -> None:
        self._db = db
        self.failures = failures
        self.dialect = db.dialect

    async def execute_many(self, sql, rows):
        if self.failures:
            self.failures -= 1
            raise StoreError("connection reset (injected)")
        await self._db.execute_many(sql, rows)

    def __getattr__(self, name):
        return getattr(self._db, name)


async def test_writer_retries_store_failures_and_stores_the_turn_once(ctx, redis_a):
    flaky = FlakyDatabase(ctx.db, failures=2)
    store = SessionStore(flaky, RegionCache("a", redis_a), prefix=ctx.settings.key_prefix, retry_backoff_s=0.001)
    try:
        t1 = turn("s1", "t1", 1)
        store.record_turn(t1)
        await store.flush()
        assert flaky.failures == 0 and store.stats.written == 1 and store.stats.failed == 0
        assert await store.read_store(TENANT, "s1") == [t1]
    finally:
        await store.close()


async def test_writer_gives_up_after_its_attempts_and_keeps_running(ctx, redis_a):
    flaky = FlakyDatabase(ctx.db, failures=3)
    store = SessionStore(
        flaky,
        RegionCache("a", redis_a),
        prefix=ctx.settings.key_prefix,
        write_attempts=3,
        retry_backoff_s=0.001,
    )
    try:
        store.record_turn(turn("s1", "t1", 1))
        await store.flush()
        assert store.stats.failed == 1
        t2 = turn("s1", "t2", 2)
        store.record_turn(t2)
        await store.flush()
        assert await store.read_store(TENANT, "s1") == [t2]
    finally:
        await store.close()


async def test_a_turn_messagepack_cannot_hold_is_stored_and_its_session_read_from_the_store(ctx, redis_a):
    # A content part a client sent may carry an integer past 64 bits (the API fuzzer's did): the store's
    # JSON keeps it, MessagePack cannot. The turn is stored, the session stops being cached (a cache
    # without that turn would answer reads with a history missing it), and reads come from the store.
    store = ctx.sessions
    t1 = turn("big", "t1", 1)
    store.record_turn(t1)
    await store.flush()
    assert await store.get_history(TENANT, "big") == [t1]  # now cached whole
    huge = Message(role="user", content=[{"type": "text", "text": "hi", "n": 2**70}])
    t2 = Turn(turn_id="t2", session_id="big", tenant_id=TENANT, created_at=t1.created_at + 1, messages=[huge])
    store.record_turn(t2)
    await store.flush()
    assert store.stats.failed == 0 and store.stats.written == 2
    assert not await redis_a.exists(store.cache_key(TENANT, "big"))
    for _ in range(2):  # the second read finds no cache either: it is not refilled without the turn
        assert await store.get_history(TENANT, "big") == [t1, t2]
    assert not await redis_a.exists(store.cache_key(TENANT, "big"))
