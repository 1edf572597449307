"""Exactly once, incrementally: a watermark per export name and the manifest of the parts written.

Rows of an export are totally ordered by a *position* (a JSON list compared as a tuple: a chat turn's
``[created_at, tenant_id, session_id, turn_id]``, a preference pair's ``[time, chosen, rejected]``).
A run exports the rows past its name's watermark, in position order, in parts of a bounded size:

1. part ``seq`` (the number of parts the name has committed) is written under a name fixed by
   ``(export name, seq)`` and made durable (``sink``);
2. in one transaction, the manifest row ``(name, seq, uri, rows, first, last)`` is inserted and the
   watermark moved to the part's last position.

A run killed between 1 and 2 leaves a part no manifest row names; the next run starts from the same
watermark, so it writes the same ``seq`` again and the object is replaced, not duplicated. A run killed
after 2 resumes after the part. Two runs of one name at once both try to insert the same ``(name, seq)``:
the primary key refuses the second, whose transaction rolls back (``StoreError``). An export name keeps
its format: reusing it for another is a ``ConfigError``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from contracts.errors import ConfigError
from telemetry.export.db import ExportDb

Position = tuple[Any, ...]

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS tandem_export_watermarks (
        name TEXT PRIMARY KEY,
        format TEXT NOT NULL,
        position TEXT NOT NULL,
        parts BIGINT NOT NULL,
        total_rows BIGINT NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS tandem_export_parts (
        name TEXT NOT NULL,
        seq BIGINT NOT NULL,
        uri TEXT NOT NULL,
        n_rows BIGINT NOT NULL,
        first_position TEXT NOT NULL,
        last_position TEXT NOT NULL,
        written_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (name, seq))""",
    """CREATE TABLE IF NOT EXISTS tandem_export_runs (
        name TEXT NOT NULL,
        started_at DOUBLE PRECISION NOT NULL,
        format TEXT NOT NULL,
        dry_run INTEGER NOT NULL,
        n_rows BIGINT NOT NULL,
        summary TEXT NOT NULL,
        PRIMARY KEY (name, started_at))""",
)

_UPSERT = """INSERT INTO tandem_export_watermarks (name, format, position, parts, total_rows, updated_at)
    VALUES ($1, $2, $3, $4, $5, $6)
    ON CONFLICT (name) DO UPDATE SET position = excluded.position, parts = excluded.parts,
        total_rows = excluded.total_rows, updated_at = excluded.updated_at"""
_PART = """INSERT INTO tandem_export_parts (name, seq, uri, n_rows, first_position, last_position, written_at)
    VALUES ($1, $2, $3, $4, $5, $6, $7)"""


@dataclass(frozen=True, slots=True)
class Watermark:
    name: str
    format: str
    position: Position | None
    """The last position exported; None: nothing yet."""
    parts: int = 0
    """Parts committed: the next part's ``seq``."""
    rows: int = 0
    updated_at: float | None = None

    def passes(self, position: Position) -> bool:
        """True if ``position`` is past the watermark (not exported yet)."""
        return self.position is None or tuple(position) > tuple(self.position)


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    seq: int
    uri: str
    rows: int
    first: Position
    last: Position
    written_at: float


def encode(position: Position) -> str:
    return json.dumps(list(position))


def decode(text: str) -> Position:
    return tuple(json.loads(text))


def init_schema(db: ExportDb) -> None:
    db.transaction([(stmt, ()) for stmt in SCHEMA])


def load(db: ExportDb, name: str, fmt: str) -> Watermark:
    """The watermark of ``name`` (a fresh one if the name is new)."""
    rows = db.fetch(
        "SELECT format, position, parts, total_rows, updated_at FROM tandem_export_watermarks WHERE name = $1", name
    )
    if not rows:
        return Watermark(name=name, format=fmt, position=None)
    f, pos, parts, total, updated = rows[0]
    if f != fmt:
        raise ConfigError(f"export {name!r} writes {f}, not {fmt}: give this export another --name")
    return Watermark(name, f, decode(pos), int(parts), int(total), float(updated))


def commit(db: ExportDb, wm: Watermark, uri: str, rows: int, first: Position, last: Position) -> Watermark:
    """Record part ``wm.parts`` (already durable at ``uri``) and move the watermark past it, atomically."""
    now = time.time()
    db.transaction(
        [
            (_PART, (wm.name, wm.parts, uri, rows, encode(first), encode(last), now)),
            (_UPSERT, (wm.name, wm.format, encode(last), wm.parts + 1, wm.rows + rows, now)),
        ]
    )
    return Watermark(wm.name, wm.format, tuple(last), wm.parts + 1, wm.rows + rows, now)


def parts(db: ExportDb, name: str) -> list[Part]:
    rows = db.fetch(
        """SELECT name, seq, uri, n_rows, first_position, last_position, written_at FROM tandem_export_parts
           WHERE name = $1 ORDER BY seq""",
        name,
    )
    return [Part(n, int(s), u, int(r), decode(f), decode(la), float(w)) for n, s, u, r, f, la, w in rows]


def watermarks(db: ExportDb) -> list[Watermark]:
    if not db.has_table("tandem_export_watermarks"):
        return []
    rows = db.fetch("SELECT name, format, position, parts, total_rows, updated_at FROM tandem_export_watermarks")
    return sorted(
        (Watermark(n, f, decode(p), int(k), int(t), float(u)) for n, f, p, k, t, u in rows), key=lambda w: w.name
    )


def record_run(db: ExportDb, name: str, started_at: float, fmt: str, dry_run: bool, rows: int, summary: dict) -> None:
    """Keep what a run did (rows per tenant, what was filtered and why) for ``tandem lake report``."""
    db.execute(
        """INSERT INTO tandem_export_runs (name, started_at, format, dry_run, n_rows, summary)
           VALUES ($1, $2, $3, $4, $5, $6)""",
        name,
        started_at,
        fmt,
        int(dry_run),
        rows,
        json.dumps(summary, sort_keys=True),
    )


def last_runs(db: ExportDb) -> list[tuple[str, float, str, bool, int, dict]]:
    """The latest run of each export name: (name, started_at, format, dry_run, rows, summary)."""
    if not db.has_table("tandem_export_runs"):
        return []
    rows = db.fetch(
        """SELECT r.name, r.started_at, r.format, r.dry_run, r.n_rows, r.summary FROM tandem_export_runs r
           WHERE r.started_at = (SELECT max(started_at) FROM tandem_export_runs x WHERE x.name = r.name)
           ORDER BY r.name"""
    )
    return [(n, float(s), f, bool(d), int(k), json.loads(j)) for n, s, f, d, k, j in rows]


__all__ = ["Part", "Position", "Watermark", "commit", "init_schema", "load", "parts", "record_run", "watermarks"]
