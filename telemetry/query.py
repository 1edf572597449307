"""DuckDB over the Parquet lake.

``connect(lake)`` returns an in-memory DuckDB connection with one view per telemetry table
(``requests``, ``tool_calls``, ``feedback``, ``errors``, ``kv_events``, ``host_tier``), each over
``read_parquet([...], hive_partitioning = true)`` so that the partition columns ``date`` (DATE) and
``hour`` (INTEGER) are queryable. The file list comes from ``lake_files``, which hides the inputs of a
compaction whose output is already in place (so a query never sees a row twice while a compaction
finishes) and temporary files. A table without files is still a view, empty, with the full schema,
so queries on an empty lake return no rows rather than failing. Likewise a column added by a later
schema version (``telemetry.schemas``) that none of the files has yet (a lake written before it) is in
the view as NULLs of its type, so every query written for the current schema runs on every lake.

    from telemetry.query import query
    query(Path("lake"), "SELECT count(*) FROM requests WHERE status = 'ok'")   # -> pyarrow.Table
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa

from telemetry.schemas import SCHEMAS, TABLE_NAMES

_HIVE_TYPES = "{'date': DATE, 'hour': INTEGER}"


def lake_files(lake: Path, table: str) -> list[Path]:
    """The Parquet files that make up ``table`` now (compaction inputs already merged are left out)."""
    tdir = Path(lake) / table
    if not tdir.is_dir():
        return []
    files: list[Path] = []
    for pdir in sorted(tdir.glob("date=*/hour=*")):
        hidden: set[str] = set()
        for manifest in pdir.glob("_compact-*.json"):
            try:
                m = json.loads(manifest.read_text())
            except (OSError, ValueError):
                continue
            if (pdir / m["output"]).exists():
                hidden.update(m["inputs"])
        files.extend(p for p in sorted(pdir.glob("part-*.parquet")) if p.name not in hidden)
    return files


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _duck_type(t: pa.DataType) -> str:
    """DuckDB's name for an Arrow type of our schemas (for a NULL column a lake's files lack)."""
    if pa.types.is_timestamp(t):
        return "TIMESTAMPTZ"
    if pa.types.is_list(t):
        return _duck_type(t.value_type) + "[]"
    names = {pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN"}
    if t not in names:
        raise TypeError(f"no DuckDB type for {t}")
    return names[t]


def connect(lake: Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view per telemetry table over ``lake``."""
    con = duckdb.connect(":memory:")
    for table in TABLE_NAMES:
        files = lake_files(lake, table)
        if files:
            lst = ", ".join(_sql_str(str(p)) for p in files)
            source = (
                f"read_parquet([{lst}], hive_partitioning = true, hive_types = {_HIVE_TYPES}, union_by_name = true)"
            )
            have = {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()}
            added = "".join(
                f", CAST(NULL AS {_duck_type(f.type)}) AS {f.name}" for f in SCHEMAS[table] if f.name not in have
            )
            con.execute(f"CREATE VIEW {table} AS SELECT *{added} FROM {source}")
        else:
            empty = SCHEMAS[table].empty_table()
            empty = empty.append_column("date", pa.array([], pa.date32()))
            empty = empty.append_column("hour", pa.array([], pa.int32()))
            con.register(f"_empty_{table}", empty)
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM _empty_{table}")
    return con


def query(lake: Path, sql: str) -> pa.Table:
    """Run ``sql`` over the lake; the result as an Arrow table."""
    con = connect(lake)
    try:
        rel = con.sql(sql)
        return rel.to_arrow_table() if rel is not None else pa.table({})
    finally:
        con.close()


def table_counts(lake: Path) -> dict[str, int]:
    """Rows per table."""
    con = connect(lake)
    try:
        return {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLE_NAMES}
    finally:
        con.close()
