"""Which response ids this cluster produced, so feedback can be checked against them.

Written after a request finishes, off the fast path (a background task, never awaited by a handler);
a lost write only means that one response cannot receive feedback.
"""

from __future__ import annotations

import logging

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from contracts.errors import NotFound, StoreError
from router.background import TaskSet

log = logging.getLogger("tandem.router.responses")
TTL_S = 7 * 24 * 3600


class ResponseRef(msgspec.Struct, frozen=True):
    request_id: str
    session_id: str | None = None
    tenant_id: str | None = None


class ResponseIndex:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._tasks = TaskSet()

    def remember(self, response_id: str, ref: ResponseRef) -> None:
        self._tasks.spawn(self._write(response_id, ref))

    async def _write(self, response_id: str, ref: ResponseRef) -> None:
        try:
            await self._redis.set(f"tandem:response:{response_id}", msgspec.msgpack.encode(ref), ex=TTL_S)
        except RedisError as exc:
            log.warning("response id %s not recorded: %s", response_id, exc)

    async def lookup(self, response_id: str) -> ResponseRef:
        try:
            raw = await self._redis.get(f"tandem:response:{response_id}")
        except RedisError as exc:
            raise StoreError(f"response index unreadable: {exc}") from exc
        if raw is None:
            raise NotFound(f"No response with id `{response_id}`.", param="response_id")
        return msgspec.msgpack.decode(raw, type=ResponseRef)

    async def drain(self) -> None:
        await self._tasks.drain()
