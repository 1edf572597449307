"""Routers starting at once on a fresh PostgreSQL create the key and session tables together: every one
of them must start (``CREATE ... IF NOT EXISTS`` alone is not safe against a concurrent creator)."""

from __future__ import annotations

import asyncio

from router.admission.keys import SCHEMA as KEY_SCHEMA
from router.sessions.sql import open_database
from router.sessions.store import SCHEMA as SESSION_SCHEMA
from tests.router.admission.support import pg_url  # noqa: F401  (fixture)

CREATORS = 6


async def test_concurrent_schema_creators_on_a_fresh_database_all_succeed(pg_url: str) -> None:  # noqa: F811
    dbs = [await open_database(pg_url) for _ in range(CREATORS)]
    try:
        results = await asyncio.gather(
            *(db.create_schema((*KEY_SCHEMA, *SESSION_SCHEMA)) for db in dbs), return_exceptions=True
        )
        assert [r for r in results if r is not None] == []
        rows = await dbs[0].fetch("SELECT COUNT(*) FROM tandem_api_keys")
        assert rows[0][0] == 0  # the table exists, once
    finally:
        for db in dbs:
            await db.close()
