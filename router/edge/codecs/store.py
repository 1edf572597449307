"""Stored Responses: what ``previous_response_id``, ``GET /v1/responses/{id}`` and ``input_items`` read.

A response is stored under its cluster and tenant (``<cluster prefix>resp:<tenant>:<id>``, one Redis
value, 7 days; the prefix of ``contracts.cluster``), so another cluster's or another tenant's id is as
unknown as one never made. The record keeps the whole conversation up to and including
the response's output (internal messages), the Response object as answered, and the chain's session key:
a chain of responses is one session (affinity, retention, the lake), keyed by the session the first
response had (a client header, or the first response's own id).
"""

from __future__ import annotations

import msgspec
import redis.asyncio as aioredis

from contracts.errors import NotFound
from router.edge.codecs.internal import Message

TTL_S = 7 * 24 * 3600


class StoredResponse(msgspec.Struct):
    messages: list[Message]
    """The conversation through this response's output: the next turn's history."""
    input_count: int
    """How many of ``messages`` were this response's input."""
    response: dict[str, object]
    session_id: str


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(StoredResponse)


class ResponseStore:
    def __init__(self, redis: aioredis.Redis, prefix: str = "tandem:") -> None:
        self.redis = redis
        self.prefix = prefix
        """The cluster's key prefix (``contracts.cluster.prefix``)."""

    def _key(self, tenant_id: str | None, response_id: str) -> str:
        return f"{self.prefix}resp:{tenant_id or '-'}:{response_id}"

    async def save(self, tenant_id: str | None, response_id: str, record: StoredResponse, durable: bool = True) -> None:
        """Store the record; ``durable=False`` (the request said ``store: false``): nothing to keep."""
        if not durable:
            return
        await self.redis.set(self._key(tenant_id, response_id), _enc.encode(record), ex=TTL_S)

    async def load(self, tenant_id: str | None, response_id: str, param: str = "response_id") -> StoredResponse:
        raw = await self.redis.get(self._key(tenant_id, response_id))
        if raw is None:
            raise NotFound(f"Response with id '{response_id}' not found.", param=param)
        return _dec.decode(raw)

    async def delete(self, tenant_id: str | None, response_id: str) -> None:
        if not await self.redis.delete(self._key(tenant_id, response_id)):
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")


class SocketResponses(ResponseStore):
    """The store as one WebSocket sees it: its last response in memory, every other from Redis."""

    def __init__(self, store: ResponseStore) -> None:
        super().__init__(store.redis, store.prefix)
        self._last: tuple[str | None, str, StoredResponse] | None = None

    async def save(self, tenant_id: str | None, response_id: str, record: StoredResponse, durable: bool = True) -> None:
        self._last = (tenant_id, response_id, record)
        await super().save(tenant_id, response_id, record, durable)

    async def load(self, tenant_id: str | None, response_id: str, param: str = "response_id") -> StoredResponse:
        last = self._last
        if last is not None and last[0] == tenant_id and last[1] == response_id:
            return last[2]
        return await super().load(tenant_id, response_id, param)
