"""The response index (router.record.responses) against a real Redis: batched writes, answers before the
write lands, and a Redis outage that loses the ids without touching the caller."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from contracts.errors import NotFound
from router.record.responses import MAX_BATCH, ResponseIndex, ResponseRef


def _ids(n: int) -> list[str]:
    return [f"chatcmpl-{uuid.uuid4().hex}" for _ in range(n)]


async def test_ids_filed_together_are_written_in_one_round_trip(redis_unit_url: str) -> None:
    client = aioredis.from_url(redis_unit_url)
    index = ResponseIndex(client)
    ids = _ids(100)
    for rid in ids:  # as many answers ending within one loop turn
        index.remember(rid, ResponseRef(rid, "s1", "t1"))
    await index.drain()
    assert (index.written, index.batches, index.lost) == (100, 1, 0)
    assert await client.exists(*[f"tandem:response:{rid}" for rid in ids]) == 100
    assert 0 < await client.ttl(f"tandem:response:{ids[0]}") <= 7 * 24 * 3600
    fresh = ResponseIndex(client)  # another router replica reads them from Redis
    assert await fresh.lookup(ids[7]) == ResponseRef(ids[7], "s1", "t1")
    await client.delete(*[f"tandem:response:{rid}" for rid in ids])
    await client.aclose()


async def test_a_batch_never_exceeds_the_bound(redis_unit_url: str) -> None:
    client = aioredis.from_url(redis_unit_url)
    index = ResponseIndex(client)
    ids = _ids(MAX_BATCH + 3)
    for rid in ids:
        index.remember(rid, ResponseRef(rid))
    await index.drain()
    assert (index.written, index.batches) == (MAX_BATCH + 3, 2)
    await client.delete(*[f"tandem:response:{rid}" for rid in ids])
    await client.aclose()


async def test_feedback_right_after_the_stream_finds_the_id_before_it_is_written(redis_unit_url: str) -> None:
    client = aioredis.from_url(redis_unit_url)
    index = ResponseIndex(client)
    (rid,) = _ids(1)
    index.remember(rid, ResponseRef(rid, None, "t1"))
    # No await since remember(): the writer task cannot have run, so this answer came from the queue.
    lookup = index.lookup(rid)
    assert index.written == 0 and index.batches == 0
    assert (await lookup).tenant_id == "t1"
    await index.drain()
    assert await client.exists(f"tandem:response:{rid}") == 1
    await client.delete(f"tandem:response:{rid}")
    await client.aclose()


async def test_redis_down_loses_the_ids_counted_and_never_raises() -> None:
    # A port nothing listens on: connection refused at once.
    client = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    index = ResponseIndex(client)
    ids = _ids(3)
    for rid in ids:
        index.remember(rid, ResponseRef(rid))
    await index.drain()
    assert (index.written, index.lost) == (0, 3)
    assert not index._pending  # dropped, not kept growing while Redis is away
    await asyncio.sleep(0)
    await client.aclose()


async def test_ids_that_end_apart_within_the_window_share_one_round_trip(redis_unit_url: str) -> None:
    client = aioredis.from_url(redis_unit_url)
    index = ResponseIndex(client, window_s=0.5)
    first, second = _ids(2)
    index.remember(first, ResponseRef(first))
    await asyncio.sleep(0.05)  # the next answer ends a little later, as under a CPU engine's load
    index.remember(second, ResponseRef(second))
    assert index._writer is not None
    await index._writer
    assert (index.written, index.batches) == (2, 1)
    await client.delete(*[f"tandem:response:{rid}" for rid in (first, second)])
    await client.aclose()


async def test_another_replica_asked_within_the_window_finds_the_id(redis_unit_url: str) -> None:
    client = aioredis.from_url(redis_unit_url)
    serving, other = ResponseIndex(client, window_s=0.3), ResponseIndex(client, window_s=0.3)
    (rid,) = _ids(1)
    serving.remember(rid, ResponseRef(rid, "s1", "t1"))
    # Feedback at once, through the replica that did not serve it: not in Redis yet, found after the window.
    assert (await other.lookup(rid)).tenant_id == "t1"
    assert serving.written == 1
    with pytest.raises(NotFound):
        await other.lookup(f"chatcmpl-{uuid.uuid4().hex}")  # ours in shape: refused after the window
    started = asyncio.get_running_loop().time()
    with pytest.raises(NotFound):
        await other.lookup("resp_made-up")  # no id of ours looks like this: refused at once
    assert asyncio.get_running_loop().time() - started < other.window_s
    await client.delete(f"tandem:response:{rid}")
    await client.aclose()
