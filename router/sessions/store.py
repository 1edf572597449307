"""Session history: a per-region Redis cache in front of the persistent store (PostgreSQL or SQLite).

Layout
    store:  table ``tandem_turns`` (tenant_id, session_id, turn_id) primary key, created_at, body (JSON
            of ``Turn``). Sessions are namespaced by tenant: one tenant cannot read another's session.
    cache:  one Redis hash per session and region, ``<prefix>sess:<tenant>:<session>``: field
            ``<turn_id>`` → msgpack ``Turn``, plus the marker field ``~`` meaning "this hash holds the
            whole session". TTL ``cache_ttl_s``, refreshed on every write and refill.

Writes (off the fast path)
    ``record_turn`` only enqueues (bounded ``asyncio.Queue``; when full the turn is dropped and counted,
    the fast path never waits). A background task drains the queue in batches: first the store
    (``INSERT ... ON CONFLICT DO NOTHING``: a turn id is stored once, so retries are safe), then the
    caches with ``HSETNX``: always in the home region, and in other regions only where the session is
    already cached (asynchronous replication of hot sessions; cold ones are read from the store).
    Store failures are retried ``write_attempts`` times with backoff, then counted as failed.

Reads
    ``get_history``: the home region's hash when it carries the marker; otherwise the store, then a
    refill (``HSETNX`` every turn, then set the marker) unless the session has more than
    ``max_cached_turns`` turns. A turn written between the store read and the refill is not lost: the
    writer's ``HSETNX`` lands in the hash either before or after the refill. A Redis failure on a read
    falls back to the store (the cache is an optimisation); only both failing raises ``StoreError``.

Regions: each router names its own region's cache ``home`` and the others ``others``; all share one
store (``router.sessions.sql`` follows a PostgreSQL failover to a promoted replica). A region whose
cache cannot be reached costs each batch that cache's connect timeout, and its cache misses those turns:
a region that comes back must start with an empty session cache. ``tests/lab/test_regions.py`` loses a
region mid-session.

Known gap: a ``delete`` racing an in-flight write or refill of the same session can leave that turn in
the cache (until its TTL) or in the store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from contracts.errors import StoreError
from router.sessions.models import Message, Turn, conversation, validate_id
from router.sessions.sql import Database

log = logging.getLogger(__name__)

MARKER = "~"
_MARKER_B = MARKER.encode()

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS tandem_turns (
        tenant_id TEXT NOT NULL,
        session_id TEXT NOT NULL,
        turn_id TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (tenant_id, session_id, turn_id))""",
)

_INSERT = """INSERT INTO tandem_turns (tenant_id, session_id, turn_id, created_at, body)
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant_id, session_id, turn_id) DO NOTHING"""
_SELECT = """SELECT body FROM tandem_turns WHERE tenant_id = $1 AND session_id = $2
             ORDER BY created_at, turn_id"""

# KEYS[1] session hash. ARGV: 1 turn id, 2 body, 3 ttl ms, 4 '1' = only if the hash exists, 5 max turns
_APPEND_LUA = """
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
if redis.call('HLEN', KEYS[1]) > tonumber(ARGV[5]) + 1 then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS[1] session hash. ARGV: 1 ttl ms, then turn id, body pairs
_REFILL_LUA = """
for i = 2, #ARGV, 2 do redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[1], '~', '1')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

_msgpack_enc = msgspec.msgpack.Encoder()
_msgpack_dec = msgspec.msgpack.Decoder(Turn)
_json_enc = msgspec.json.Encoder()
_json_dec = msgspec.json.Decoder(Turn)


def _packed(turn: Turn) -> bytes | None:
    """The turn as a cache entry, or None where MessagePack cannot hold it: a content part the client
    sent may carry an integer past 64 bits, which the store's JSON keeps. Such a session is not cached
    (its reads go to the store), rather than cached without that turn."""
    try:
        return _msgpack_enc.encode(turn)
    except OverflowError:
        return None


@dataclass(frozen=True, slots=True)
class RegionCache:
    """One region's Redis (a server, or a logical database of one). Its client must return bytes
    (``decode_responses=False``, the default): cached turns are msgpack."""

    name: str
    redis: aioredis.Redis


@dataclass(slots=True)
class WriterStats:
    enqueued: int = 0
    written: int = 0
    """Turns the writer finished (including retried duplicates the store ignored)."""
    dropped: int = 0
    """Turns refused because the queue was full."""
    failed: int = 0
    """Turns given up after ``write_attempts`` store failures."""
    cache_errors: int = 0


def _order(t: Turn) -> tuple[float, str]:
    return (t.created_at, t.turn_id)


class SessionStore:
    def __init__(
        self,
        db: Database,
        home: RegionCache,
        others: Sequence[RegionCache] = (),
        *,
        prefix: str = "tandem:",
        cache_ttl_s: float = 86_400.0,
        max_cached_turns: int = 500,
        queue_size: int = 10_000,
        batch_size: int = 64,
        write_attempts: int = 5,
        retry_backoff_s: float = 0.1,
    ) -> None:
        self._db = db
        self.home = home
        self.others = tuple(others)
        self.prefix = prefix
        self._ttl_ms = str(int(cache_ttl_s * 1000))
        self.max_cached_turns = max_cached_turns
        self._queue: asyncio.Queue[Turn] = asyncio.Queue(maxsize=queue_size)
        self._batch_size = batch_size
        self._write_attempts = write_attempts
        self._retry_backoff_s = retry_backoff_s
        self._writer: asyncio.Task[None] | None = None
        self.stats = WriterStats()
        self._append = {r.name: r.redis.register_script(_APPEND_LUA) for r in (home, *self.others)}
        self._refill = home.redis.register_script(_REFILL_LUA)

    def cache_key(self, tenant_id: str, session_id: str) -> str:
        return f"{self.prefix}sess:{tenant_id}:{session_id}"

    async def init_schema(self) -> None:
        await self._db.create_schema(SCHEMA)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background writer (idempotent). Needs a running event loop."""
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._run(), name="session-writer")

    async def flush(self) -> None:
        """Wait until every enqueued turn has been written (or given up)."""
        await self._queue.join()

    async def close(self) -> None:
        """Drain the queue, then stop the writer."""
        if self._writer is not None and not self._writer.done():
            await self.flush()
            self._writer.cancel()
            try:
                await self._writer
            except asyncio.CancelledError:
                pass
        self._writer = None

    # -- writes ------------------------------------------------------------------------------------
    def record_turn(self, turn: Turn) -> bool:
        """Enqueue a finished turn for writing; never blocks. False when the queue is full (the turn is
        dropped and counted in ``stats.dropped``)."""
        validate_id(turn.session_id, "session_id")
        validate_id(turn.turn_id, "turn_id")
        if self._writer is None or self._writer.done():
            self.start()
        try:
            self._queue.put_nowait(turn)
        except asyncio.QueueFull:
            self.stats.dropped += 1
            log.warning("session writer queue full: dropped turn %s of session %s", turn.turn_id, turn.session_id)
            return False
        self.stats.enqueued += 1
        return True

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._write_batch(batch)
            except Exception:  # a bug here must not kill the writer and silently fill the queue
                self.stats.failed += len(batch)
                log.exception("session writer failed on a batch of %d turns", len(batch))
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _write_batch(self, batch: list[Turn]) -> None:
        rows = [(t.tenant_id, t.session_id, t.turn_id, t.created_at, _json_enc.encode(t).decode()) for t in batch]
        for attempt in range(self._write_attempts):
            try:
                await self._db.execute_many(_INSERT, rows)
                break
            except StoreError as exc:
                if attempt + 1 == self._write_attempts:
                    self.stats.failed += len(batch)
                    log.error("giving up on %d session turns after %d attempts: %s", len(batch), attempt + 1, exc)
                    return
                await asyncio.sleep(self._retry_backoff_s * 2**attempt)
        packed = [(t, _packed(t)) for t in batch]
        uncached = {self.cache_key(t.tenant_id, t.session_id) for t, body in packed if body is None}
        for region in (self.home, *self.others):
            only_if_cached = "0" if region is self.home else "1"
            try:
                async with region.redis.pipeline(transaction=False) as pipe:
                    for t, body in packed:
                        if body is None:
                            continue
                        await self._append[region.name](
                            keys=[self.cache_key(t.tenant_id, t.session_id)],
                            args=[t.turn_id, body, self._ttl_ms, only_if_cached, self.max_cached_turns],
                            client=pipe,
                        )
                    await pipe.execute()
                if uncached:  # (after the appends: a later turn of the batch must not cache it again)
                    await region.redis.delete(*uncached)
            except RedisError as exc:
                # the store has the turns; this region reads them from there on its next miss
                self.stats.cache_errors += 1
                log.warning("session cache write to region %s failed: %s", region.name, exc)
        self.stats.written += len(batch)

    # -- reads -------------------------------------------------------------------------------------
    async def get_history(self, tenant_id: str, session_id: str) -> list[Turn]:
        """The session's turns in order; empty for an unknown session."""
        validate_id(session_id, "session_id")
        key = self.cache_key(tenant_id, session_id)
        try:
            cached: dict[bytes, bytes] | None = await self.home.redis.hgetall(key)  # type: ignore[assignment]
        except RedisError as exc:
            log.warning("session cache read in region %s failed, reading the store: %s", self.home.name, exc)
            cached = None
        if cached and _MARKER_B in cached:
            turns = [_msgpack_dec.decode(v) for k, v in cached.items() if k != _MARKER_B]
            return sorted(turns, key=_order)
        turns = await self.read_store(tenant_id, session_id)
        if cached is not None and len(turns) <= self.max_cached_turns:
            await self._refill_cache(key, turns)
        return turns

    async def _refill_cache(self, key: str, turns: list[Turn]) -> None:
        args: list[str | bytes] = [self._ttl_ms]
        for t in turns:
            body = _packed(t)
            if body is None:
                return  # not cached (``_packed``)
            args += [t.turn_id, body]
        try:
            await self._refill(keys=[key], args=args)
        except RedisError as exc:
            log.warning("session cache refill in region %s failed: %s", self.home.name, exc)

    async def read_store(self, tenant_id: str, session_id: str) -> list[Turn]:
        rows = await self._db.fetch(_SELECT, tenant_id, session_id)
        return [_json_dec.decode(r[0]) for r in rows]

    async def assemble_prompt(self, tenant_id: str, session_id: str, new: Sequence[Message]) -> list[Message]:
        """History mode: the stored conversation followed by the request's new messages."""
        return [*conversation(await self.get_history(tenant_id, session_id)), *new]

    # -- delete ------------------------------------------------------------------------------------
    async def delete(self, tenant_id: str, session_id: str) -> bool:
        """Remove a session from the store and from every region's cache. True if it existed anywhere.
        Raises ``StoreError`` if the store or any region's cache could not be cleared."""
        validate_id(session_id, "session_id")
        removed = await self._db.execute(
            "DELETE FROM tandem_turns WHERE tenant_id = $1 AND session_id = $2", tenant_id, session_id
        )
        key = self.cache_key(tenant_id, session_id)
        failed: list[str] = []
        for region in (self.home, *self.others):
            try:
                async with region.redis.pipeline(transaction=True) as pipe:
                    pipe.hlen(key)
                    pipe.hexists(key, MARKER)
                    pipe.delete(key)
                    size, marked, _ = await pipe.execute()
                removed += size - int(bool(marked))  # turns only: a cached "empty session" is nothing
            except RedisError as exc:
                failed.append(f"{region.name}: {exc}")
        if failed:
            raise StoreError(f"session {session_id} deleted from the store but not from caches: {failed}")
        return removed > 0
