"""Server-history assembly (``prepend_history``) over the real store: Redis DB 4 as the region's cache,
PostgreSQL and SQLite as the store, read from the cache or, after a miss, from the store."""

from __future__ import annotations

from router.sessions.http import prepend_history
from router.sessions.models import conversation
from tests.router.sessions.test_store import TENANT, turn


async def test_stored_conversation_then_the_new_messages(ctx):
    store = ctx.sessions
    for n in (1, 2, 3):
        store.record_turn(turn("s-hist", f"t{n}", n))
    await store.flush()
    new = [{"role": "tool", "tool_call_id": "call_3", "content": "42"}]
    assembled = await prepend_history(store, TENANT, "s-hist", new)
    assert assembled == [
        {"role": "user", "content": "question 1"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "function": {"name": "read_file", "arguments": '{"p":"a.py"}'}, "type": "function"}
            ],
        },
        {"role": "tool", "content": "print('hi')", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "answer 2"},
        {"role": "user", "content": "question 3"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_3", "function": {"name": "read_file", "arguments": '{"p":"a.py"}'}, "type": "function"}
            ],
        },
        *new,
    ]
    # The same from the store alone, after the region's cache lost the session.
    await ctx.redis.delete(store.cache_key(TENANT, "s-hist"))
    assert await prepend_history(store, TENANT, "s-hist", new) == assembled
    assert len(conversation(await store.get_history(TENANT, "s-hist"))) == 6


async def test_an_unknown_session_or_another_tenants_has_no_history(ctx):
    store = ctx.sessions
    store.record_turn(turn("s-mine", "t1", 1))
    await store.flush()
    new = [{"role": "user", "content": "hello"}]
    assert await prepend_history(store, TENANT, "s-unknown", new) == new
    assert await prepend_history(store, "other-tenant", "s-mine", new) == new
