"""The session store, as the export sees it: a small synchronous SQL connection to the router's database.

The router's own driver layer (``router.sessions.sql``) is async and sits above telemetry in the import
layers, so the export keeps its own, as small as it needs: PostgreSQL through asyncpg (driven on a
private event loop: the export is a batch command, not a server) or SQLite through the standard library.
SQL is written once, PostgreSQL-style (``$1, $2 ...``); SQLite gets ``?1, ?2 ...`` (its numbered
parameters). A ``?schema=NAME`` on a PostgreSQL URL sets the search path, as the router reads it.
Driver errors become ``StoreError`` here, at the boundary.

``transaction(statements)`` runs several statements atomically: the watermark and the manifest row of a
part are committed together or not at all.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg

from contracts.errors import ConfigError, StoreError

Row = tuple[Any, ...]
Statement = tuple[str, Sequence[Any]]

_PLACEHOLDER = re.compile(r"\$(\d+)")
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
TIMEOUT_S = 30.0


class ExportDb(Protocol):
    dialect: str

    def fetch(self, sql: str, *args: Any) -> list[Row]: ...

    def transaction(self, statements: Sequence[Statement]) -> list[int]:
        """Run ``statements`` in one transaction; the rows each changed. All or nothing."""
        ...

    def execute(self, sql: str, *args: Any) -> int: ...

    def has_table(self, name: str) -> bool: ...

    def close(self) -> None: ...


class PostgresDb:
    dialect = "postgresql"

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        schema = query.pop("schema", None)
        if schema is not None and not _SCHEMA_NAME.match(schema):
            raise ConfigError(f"invalid schema name {schema!r} in database URL")
        dsn = urlunsplit(parts._replace(query=urlencode(query)))
        self._loop = asyncio.new_event_loop()
        try:
            self._conn: asyncpg.Connection = self._run(self._connect(dsn, schema), f"connect to {parts.hostname}")
        except BaseException:
            self._loop.close()
            raise

    @staticmethod
    async def _connect(dsn: str, schema: str | None) -> asyncpg.Connection:
        conn = await asyncpg.connect(dsn, timeout=TIMEOUT_S, command_timeout=TIMEOUT_S)
        if schema:
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            await conn.execute(f'SET search_path TO "{schema}"')
        return conn

    def _run(self, coro: Any, what: str) -> Any:
        try:
            return self._loop.run_until_complete(coro)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise StoreError(f"PostgreSQL {what} failed: {exc}") from exc

    def fetch(self, sql: str, *args: Any) -> list[Row]:
        records = self._run(self._conn.fetch(sql, *args), "query")
        return [tuple(r.values()) for r in records]

    def execute(self, sql: str, *args: Any) -> int:
        return self.transaction([(sql, args)])[0]

    def transaction(self, statements: Sequence[Statement]) -> list[int]:
        async def run() -> list[int]:
            out: list[int] = []
            async with self._conn.transaction():
                for sql, args in statements:
                    status = await self._conn.execute(sql, *args)
                    tail = status.rsplit(" ", 1)[-1]
                    out.append(int(tail) if tail.isdigit() else 0)
            return out

        result: list[int] = self._run(run(), "transaction")
        return result

    def has_table(self, name: str) -> bool:
        rows = self.fetch("SELECT to_regclass($1) IS NOT NULL", name)
        return bool(rows[0][0])

    def close(self) -> None:
        try:
            self._run(self._conn.close(), "close")
        finally:
            self._loop.close()


class SqliteDb:
    dialect = "sqlite"

    def __init__(self, path: Path) -> None:
        try:
            self._conn = sqlite3.connect(str(path), timeout=TIMEOUT_S, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open SQLite database {path}: {exc}") from exc

    @staticmethod
    def _sql(sql: str) -> str:
        return _PLACEHOLDER.sub(r"?\1", sql)

    def fetch(self, sql: str, *args: Any) -> list[Row]:
        try:
            return [tuple(r) for r in self._conn.execute(self._sql(sql), args).fetchall()]
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite query failed: {exc}") from exc

    def execute(self, sql: str, *args: Any) -> int:
        return self.transaction([(sql, args)])[0]

    def transaction(self, statements: Sequence[Statement]) -> list[int]:
        out: list[int] = []
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    out.append(max(self._conn.execute(self._sql(sql), tuple(args)).rowcount, 0))
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite transaction failed: {exc}") from exc
        return out

    def has_table(self, name: str) -> bool:
        return bool(self.fetch("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = $1", name))

    def close(self) -> None:
        self._conn.close()


def open_db(url: str, *, create: bool = True) -> ExportDb:
    """``postgresql://`` → PostgreSQL; ``sqlite:///path`` or a bare path → SQLite. With ``create`` False a
    SQLite file that does not exist is an error rather than a new empty database."""
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresDb(url)
    if "://" in url and not url.startswith("sqlite:///"):
        raise ConfigError(f"unsupported database URL {url!r} (want postgresql://... or sqlite:///path)")
    path = Path(url.removeprefix("sqlite:///"))
    if not create and not path.exists():
        raise StoreError(f"no session store at {path} (set TANDEM_DATABASE_URL or TANDEM_SQLITE_PATH)")
    path.parent.mkdir(parents=True, exist_ok=True)
    return SqliteDb(path)
