"""A session store (SQLite, or PostgreSQL in a schema of its own) holding turns of the router's own
``Turn`` type, and a lake folder with request and feedback parts written in the lake's schemas."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from router.sessions.models import FunctionCall, Message, ToolCall, Turn
from router.sessions.store import SCHEMA as TURNS_SCHEMA
from telemetry.export.db import ExportDb, open_db
from telemetry.schemas import SCHEMAS

PG = "postgresql://postgres@127.0.0.1:5432"
PG_DB = "tandem_test"


class Store:
    """The turns table as the router writes it, plus a lake folder."""

    def __init__(self, url: str, lake: Path) -> None:
        self.url = url
        self.lake = lake
        self.db: ExportDb = open_db(url)
        for stmt in TURNS_SCHEMA:
            self.db.execute(stmt)
        self.t0 = time.time() - 3600

    def turn(self, tenant: str, session: str, turn_id: str, at: float, messages: list[Message], **kw: Any) -> Turn:
        t = Turn(
            turn_id=turn_id,
            session_id=session,
            tenant_id=tenant,
            created_at=self.t0 + at,
            messages=messages,
            response=kw.pop("response", Message(role="assistant", content=f"answer {turn_id}")),
            model=kw.pop("model", "m"),
            **kw,
        )
        self.db.execute(
            "INSERT INTO tandem_turns (tenant_id, session_id, turn_id, created_at, body) VALUES ($1, $2, $3, $4, $5)",
            tenant,
            session,
            turn_id,
            t.created_at,
            msgspec.json.encode(t).decode(),
        )
        return t

    def lake_rows(self, table: str, rows: list[dict[str, Any]]) -> None:
        now = datetime.now(UTC)
        full = [{"event_id": uuid.uuid4().hex, "event_time": now, "source": "test", **r} for r in rows]
        folder = self.lake / table / f"date={now:%Y-%m-%d}" / f"hour={now:%H}"
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(full, schema=SCHEMAS[table]), folder / f"part-{uuid.uuid4().hex}.parquet")

    def close(self) -> None:
        self.db.close()


def user(text: str) -> Message:
    return Message(role="user", content=text)


def call(call_id: str, path: str) -> Message:
    fn = FunctionCall(name="read_file", arguments=f'{{"path": "{path}"}}')
    return Message(role="assistant", tool_calls=[ToolCall(id=call_id, function=fn)])


def result(call_id: str, text: str) -> Message:
    return Message(role="tool", tool_call_id=call_id, content=text)


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path}/tandem.db", tmp_path / "lake")
    yield s
    s.close()


async def _ensure_pg_db() -> None:
    admin = await asyncpg.connect(f"{PG}/test")
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", PG_DB):
            await admin.execute(f"CREATE DATABASE {PG_DB}")
    finally:
        await admin.close()


async def _drop_schema(schema: str) -> None:
    conn = await asyncpg.connect(f"{PG}/{PG_DB}")
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """Both backends (PostgreSQL down: the test errors, it never skips)."""
    if request.param == "sqlite":
        s = Store(f"sqlite:///{tmp_path}/tandem.db", tmp_path / "lake")
        yield s
        s.close()
        return
    asyncio.run(_ensure_pg_db())
    schema = f"x_{uuid.uuid4().hex[:12]}"
    s = Store(f"{PG}/{PG_DB}?schema={schema}", tmp_path / "lake")
    yield s
    s.close()
    asyncio.run(_drop_schema(schema))
