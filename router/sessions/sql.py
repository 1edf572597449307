"""The persistent store's connection: PostgreSQL (asyncpg) or embedded SQLite (aiosqlite).

Both the session history and the API keys persist here; Redis is only their cache. One small interface,
``Database``, hides the two drivers:

* SQL is written once, PostgreSQL-style, with ``$1, $2 ...`` placeholders. The SQLite backend rewrites
  them to ``?1, ?2 ...`` (SQLite's numbered parameters), so the same text runs on both.
* Only portable types are used: ``TEXT``, ``BIGINT``, ``DOUBLE PRECISION``, ``INTEGER`` 0/1 for flags,
  JSON documents in ``TEXT``. ``INSERT ... ON CONFLICT DO NOTHING`` works on both (SQLite >= 3.24).
* Driver errors become ``StoreError`` here, at the boundary.
* Every PostgreSQL call is bounded: connecting (and taking a pooled connection, which may reconnect)
  by ``connect_timeout_s``, each statement by ``command_timeout_s`` (asyncpg's ``command_timeout``,
  which also cancels the statement on the server). Past either: ``StoreTimeout``. A hung or overloaded
  database then fails the caller within a known time instead of holding its request (and its pool
  slot) forever.

Failover (PostgreSQL). A URL may name several servers, libpq-style, and which one to take:
``postgresql://user:pw@a:5432,b:5432/db?target_session_attrs=read-write`` connects to the first that
takes writes (asyncpg reads both). When that server is lost and another is promoted, the pool's
connections to the lost one are dead, and on a partition nothing tells the router so: a statement sent on
one would wait out its timeout. Two things end that early. Each connection's socket gives its server
``connect_timeout_s`` to answer at the TCP level (``_fail_fast_connection``: ``TCP_USER_TIMEOUT`` for
sent data, keepalive probes while idle); past it the connection breaks (a slow query does not: its
server's kernel still answers). A broken connection (``_CONNECTION_LOST``) then expires the whole pool,
whose connections went to the same server, so every next statement connects afresh to whichever server
takes writes now, and a read (``fetch``) is retried once at once on such a fresh connection: reads are
safe to repeat. A write is not retried here (it may have committed before the connection broke): its
caller retries, as the session writer does with its idempotent inserts. ``tests/lab/test_regions.py``
runs this between two regions.

``open_database(url)`` picks the backend: ``postgresql://...`` → PostgreSQL, ``sqlite:///path`` or a
bare path → SQLite. A PostgreSQL URL may carry ``?schema=NAME`` (not a libpq option; we strip it) to
keep every table inside one schema, which tests use to isolate runs.
"""

from __future__ import annotations

import math
import re
import socket
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import aiosqlite
import asyncpg

from contracts.errors import ConfigError, StoreError, StoreTimeout

Row = tuple[Any, ...]

DEFAULT_COMMAND_TIMEOUT_S = 5.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0

_CONNECTION_LOST = (OSError, asyncpg.PostgresConnectionError)
"""The connection itself broke (not a statement's error): the server restarted, was lost or cut off."""
_PLACEHOLDER = re.compile(r"\$(\d+)")
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_SCHEMA_LOCK = 0x74616E64656D  # "tandem": the advisory lock key schema creators take turns on


class Database(Protocol):
    """What the stores need from a SQL database. Every method raises ``StoreError`` on failure."""

    dialect: str

    async def execute(self, sql: str, *args: Any) -> int:
        """Run one statement; return the number of rows it changed."""
        ...

    async def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run one statement per row, all in one transaction."""
        ...

    async def create_schema(self, statements: Sequence[str]) -> None:
        """Run ``CREATE ... IF NOT EXISTS`` statements so that processes starting at once do not race."""
        ...

    async def fetch(self, sql: str, *args: Any) -> list[Row]: ...

    async def close(self) -> None: ...


def _fail_fast_connection(dead_after_s: float) -> type[asyncpg.Connection]:
    """A connection class whose TCP socket is given up once its server is silent for about
    ``dead_after_s``: data sent and never acknowledged (``TCP_USER_TIMEOUT``), and, on an idle
    connection, keepalive probes from a third of it on (so a pooled connection to a lost server is
    usually found dead, and replaced at its next use, before any statement waits on it). Probes are
    answered by the server's kernel, so a slow query keeps its connection. Linux options; elsewhere,
    and on Unix sockets, the socket is left as it is."""
    idle, interval = max(1, int(dead_after_s / 3)), max(1, int(dead_after_s / 6))
    options = {
        "TCP_USER_TIMEOUT": int(dead_after_s * 1000),
        "TCP_KEEPIDLE": idle,
        "TCP_KEEPINTVL": interval,
        "TCP_KEEPCNT": max(1, math.ceil((dead_after_s - idle) / interval)),
    }

    class _FailFastConnection(asyncpg.Connection):
        def __init__(self, protocol: Any, transport: Any, *args: Any) -> None:
            super().__init__(protocol, transport, *args)
            sock = transport.get_extra_info("socket")
            if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6) or dead_after_s <= 0:
                return
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for name, value in options.items():
                if hasattr(socket, name):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)

    return _FailFastConnection


class PostgresDatabase:
    dialect = "postgresql"

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        self._pool = pool
        self._command_timeout_s = command_timeout_s
        self._connect_timeout_s = connect_timeout_s

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        min_size: int = 1,
        max_size: int = 8,
        command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> PostgresDatabase:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        schema = query.pop("schema", None)
        dsn = urlunsplit(parts._replace(query=urlencode(query)))
        if schema is not None and not _SCHEMA_NAME.match(schema):
            raise ConfigError(f"invalid schema name {schema!r} in database URL")
        settings = {"search_path": schema} if schema else None
        where = parts.netloc.rpartition("@")[2]  # host:port, or several (``host1:port1,host2:port2``)
        try:
            if schema:
                conn = await asyncpg.connect(dsn, timeout=connect_timeout_s, command_timeout=command_timeout_s)
                try:
                    await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
                finally:
                    await conn.close()
            pool = await asyncpg.create_pool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                server_settings=settings,
                timeout=connect_timeout_s,
                command_timeout=command_timeout_s,
                connection_class=_fail_fast_connection(connect_timeout_s),
            )
        # TimeoutError before OSError: it is one (Python >= 3.10), and deserves its own message.
        except TimeoutError as exc:
            raise StoreTimeout(
                f"PostgreSQL at {where} did not answer within {connect_timeout_s:g} s (connect timeout)"
            ) from exc
        except (OSError, asyncpg.PostgresError) as exc:
            raise StoreError(f"cannot connect to PostgreSQL at {where}: {exc}") from exc
        return cls(pool, command_timeout_s=command_timeout_s, connect_timeout_s=connect_timeout_s)

    def _timed_out(self, what: str) -> StoreTimeout:
        return StoreTimeout(
            f"PostgreSQL {what} did not finish within its timeout ({self._command_timeout_s:g} s "
            f"per statement, {self._connect_timeout_s:g} s to get a connection)"
        )

    async def _lost(self, exc: BaseException) -> bool:
        """True (and the pool expired: see the module docstring) when ``exc`` broke the connection."""
        if isinstance(exc, _CONNECTION_LOST) and not isinstance(exc, TimeoutError):
            await self._pool.expire_connections()
            return True
        return False

    async def execute(self, sql: str, *args: Any) -> int:
        try:
            async with self._pool.acquire(timeout=self._connect_timeout_s) as conn:
                status = await conn.execute(sql, *args)
        except TimeoutError as exc:
            raise self._timed_out("statement") from exc
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            await self._lost(exc)
            raise StoreError(f"PostgreSQL statement failed: {exc}") from exc
        # status is e.g. "INSERT 0 1", "UPDATE 3", "DELETE 0", "CREATE TABLE"
        tail = status.rsplit(" ", 1)[-1]
        return int(tail) if tail.isdigit() else 0

    async def create_schema(self, statements: Sequence[str]) -> None:
        # PostgreSQL's IF NOT EXISTS is not safe against a concurrent creator: two routers starting on
        # a fresh database both pass the check and the loser fails on pg_type's unique index. One
        # transaction-scoped advisory lock makes the creators take turns; the second finds it all done.
        try:
            async with self._pool.acquire(timeout=self._connect_timeout_s) as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
                for stmt in statements:
                    await conn.execute(stmt)
        except TimeoutError as exc:
            raise self._timed_out("schema creation") from exc
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            await self._lost(exc)
            raise StoreError(f"PostgreSQL schema creation failed: {exc}") from exc

    async def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        try:
            async with self._pool.acquire(timeout=self._connect_timeout_s) as conn, conn.transaction():
                await conn.executemany(sql, rows)
        except TimeoutError as exc:
            raise self._timed_out("batch") from exc
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            await self._lost(exc)
            raise StoreError(f"PostgreSQL batch failed: {exc}") from exc

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        """A read; retried once on a fresh connection when its connection broke under it."""
        for retry in (True, False):
            try:
                async with self._pool.acquire(timeout=self._connect_timeout_s) as conn:
                    records = await conn.fetch(sql, *args)
                return [tuple(r.values()) for r in records]
            except TimeoutError as exc:
                raise self._timed_out("query") from exc
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                if not (await self._lost(exc) and retry):
                    raise StoreError(f"PostgreSQL query failed: {exc}") from exc
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def close(self) -> None:
        await self._pool.close()


class SqliteDatabase:
    """One connection (aiosqlite runs it on its own thread), WAL mode so readers in other processes
    (the ``tandem keys`` CLI) do not block the router."""

    dialect = "sqlite"

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    @classmethod
    async def connect(cls, path: str | Path) -> SqliteDatabase:
        path = Path(path)
        if str(path) != ":memory:":
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = await aiosqlite.connect(str(path), timeout=10.0)
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open SQLite database {path}: {exc}") from exc
        return cls(conn)

    @staticmethod
    def _sql(sql: str) -> str:
        return _PLACEHOLDER.sub(r"?\1", sql)

    async def execute(self, sql: str, *args: Any) -> int:
        try:
            cur = await self._conn.execute(self._sql(sql), args)
            await self._conn.commit()
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite statement failed: {exc}") from exc
        return max(cur.rowcount, 0)

    async def create_schema(self, statements: Sequence[str]) -> None:
        for stmt in statements:  # one connection, one writer: nothing to race with
            await self.execute(stmt)

    async def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        try:
            await self._conn.executemany(self._sql(sql), rows)
            await self._conn.commit()
        except sqlite3.Error as exc:
            await self._conn.rollback()
            raise StoreError(f"SQLite batch failed: {exc}") from exc

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        try:
            cur = await self._conn.execute(self._sql(sql), args)
            rows = await cur.fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite query failed: {exc}") from exc
        return [tuple(r) for r in rows]

    async def close(self) -> None:
        await self._conn.close()


async def open_database(
    url: str,
    *,
    command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> Database:
    """``postgresql://`` / ``postgres://`` → PostgreSQL; ``sqlite:///path`` or a plain path → SQLite.
    The timeouts bound PostgreSQL (see the module docstring); SQLite is a local file with its own busy
    timeout."""
    if url.startswith(("postgresql://", "postgres://")):
        return await PostgresDatabase.connect(
            url, command_timeout_s=command_timeout_s, connect_timeout_s=connect_timeout_s
        )
    if url.startswith("sqlite:///"):
        return await SqliteDatabase.connect(url.removeprefix("sqlite:///"))
    if "://" in url:
        raise ConfigError(f"unsupported database URL {url!r} (want postgresql://... or sqlite:///path)")
    return await SqliteDatabase.connect(url)
