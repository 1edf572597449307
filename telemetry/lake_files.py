"""The lake's files: Parquet parts written atomically, partitions by hour, entries decoded and de-duplicated,
and compaction.

Every file is written to a temporary name (``.*.tmp``, which no reader globs), fsynced, renamed into
place, and the directory fsynced (``write_parquet_atomic``); the writer (``telemetry.lake_writer``)
acknowledges stream entries only after that.

Compaction (``compact``) merges a partition's parts into one file: it writes a manifest
``_compact-<id>.json`` (inputs, output), then the output (temp, fsync, rename), then deletes the
inputs and the manifest. A crash leaves a manifest; the next compaction completes it (output present:
delete the inputs) or discards it (output absent). Readers (``telemetry.query.lake_files``) skip the
inputs of a manifest whose output exists, so no query sees a row twice. Parts whose intent is still
open, and parts younger than ``min_age_s``, are never compacted (a redo would re-create them).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from telemetry.schemas import SCHEMAS, conform

_US_PER_HOUR = 3_600_000_000


@dataclass(slots=True)
class Part:
    """Entries written together. ``data`` holds each entry's Arrow IPC bytes (None if gone)."""

    table: str
    part_id: str
    entry_ids: list[str]
    data: list[bytes | None]
    redo: bool = False
    dead: list[DeadLetter] = field(default_factory=list)
    """Entries ``write_part`` could not decode; ``commit`` moves them to the dead-letter stream."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    entry_id: str
    payload: bytes
    reason: str


@dataclass(slots=True)
class WriteStats:
    entries: int = 0
    rows: int = 0
    files: int = 0
    redone_parts: int = 0
    lost_entries: int = 0
    dead_letters: int = 0

    def add(self, other: WriteStats) -> None:
        self.entries += other.entries
        self.rows += other.rows
        self.files += other.files
        self.redone_parts += other.redone_parts
        self.lost_entries += other.lost_entries
        self.dead_letters += other.dead_letters


def entry_payload(fields: dict[bytes, bytes] | None) -> bytes | None:
    """An entry's Arrow payload: None when the entry is gone from the stream (no fields), ``b""`` when
    it exists without one (never ours: it is dead-lettered, not silently dropped)."""
    if fields is None:
        return None
    return fields.get(b"a", b"")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_parquet_atomic(table: pa.Table, final: Path, compression: str) -> None:
    """Write ``table`` to ``final``: temp name, fsync, rename, fsync the directory."""
    d = final.parent
    if not d.exists():
        d.mkdir(parents=True, exist_ok=True)
        fsync_dir(d.parent)
        fsync_dir(d.parent.parent)
    tmp = d / f".{final.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh, compression=compression)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(d)


def partition_dir(lake: Path, table: str, hour_index: int) -> Path:
    dt = datetime.fromtimestamp(hour_index * 3600, tz=UTC)
    return lake / table / f"date={dt:%Y-%m-%d}" / f"hour={dt:%H}"


def decode_entry(table: str, payload: bytes) -> pa.Table:
    """One entry's Arrow IPC payload -> rows in ``table``'s current schema. Raises ``ValueError`` (or an
    Arrow error, a subclass of it) for a payload that is not that, or rows without id or time."""
    schema = SCHEMAS[table]
    if not payload:
        raise ValueError("entry has no Arrow payload (field 'a')")
    t = conform(pa.ipc.open_stream(pa.py_buffer(payload)).read_all(), schema)
    for col in ("event_id", "event_time"):
        if col in schema.names and t.column(col).null_count:
            raise ValueError(f"{t.column(col).null_count} rows without {col}")
    return t


def decode_entries(
    table: str, data: Iterable[bytes | None], on_bad: Callable[[int, bytes, Exception], None] | None = None
) -> pa.Table:
    """Arrow IPC payloads of ``table`` -> one table in the current schema. A payload that does not decode
    raises, or, with ``on_bad``, is reported as ``on_bad(position, payload, error)`` and left out."""
    schema = SCHEMAS[table]
    tables = []
    for i, payload in enumerate(data):
        if payload is None:
            continue
        try:
            tables.append(decode_entry(table, payload))
        except (ValueError, TypeError, KeyError, pa.ArrowException) as exc:
            if on_bad is None:
                raise
            on_bad(i, payload, exc)
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def dedupe(table: pa.Table) -> pa.Table:
    """Keep the first row of each event_id."""
    ids = table.column("event_id")
    if pc.count_distinct(ids).as_py() == table.num_rows:
        return table
    idx = pa.array(range(table.num_rows), type=pa.int64())
    keep = pa.table({"event_id": ids, "i": idx}).group_by("event_id", use_threads=False).aggregate([("i", "min")])
    return table.take(pc.sort(keep.column("i_min")))


def split_by_hour(table: pa.Table) -> list[tuple[int, pa.Table]]:
    """Rows grouped by the UTC hour of event_time, in first-seen order of hours."""
    if table.num_rows == 0:
        return []
    hours = pc.divide(table.column("event_time").cast(pa.int64()), _US_PER_HOUR)
    uniq = pc.unique(hours).to_pylist()
    if len(uniq) == 1:
        return [(uniq[0], table)]
    return [(h, table.filter(pc.equal(hours, h))) for h in uniq]


@dataclass(slots=True)
class CompactResult:
    partition: Path
    inputs: list[str] = field(default_factory=list)
    output: str | None = None
    rows: int = 0


def part_id_of(path: Path) -> str:
    return path.name[len("part-") : -len(".parquet")]


def finish_compactions(pdir: Path) -> None:
    """Complete (output present) or discard (output absent) compactions a crash interrupted."""
    for manifest in sorted(pdir.glob("_compact-*.json")):
        m = json.loads(manifest.read_text())
        if (pdir / m["output"]).exists():
            for name in m["inputs"]:
                (pdir / name).unlink(missing_ok=True)
        manifest.unlink()
        fsync_dir(pdir)


def compact_partition(
    pdir: Path, *, open_parts: set[str] = frozenset(), min_age_s: float = 600.0, compression: str = "zstd"
) -> CompactResult:
    """Merge a partition's part files into one, atomically; rows de-duplicated on event_id. Skips parts
    with an open intent and parts younger than ``min_age_s``."""
    finish_compactions(pdir)
    for tmp in pdir.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
    now = time.time()
    inputs = sorted(
        p
        for p in pdir.glob("part-*.parquet")
        if part_id_of(p) not in open_parts and now - p.stat().st_mtime >= min_age_s
    )
    result = CompactResult(pdir)
    if len(inputs) < 2:
        return result
    names = [p.name for p in inputs]
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
    output = f"part-c{digest}.parquet"
    manifest = pdir / f"_compact-{digest}.json"
    tmp_manifest = pdir / f".{manifest.name}.tmp"
    with open(tmp_manifest, "w") as fh:
        json.dump({"inputs": names, "output": output}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp_manifest, manifest)
    fsync_dir(pdir)
    tables = [pq.read_table(p) for p in inputs]
    table_name = (tables[0].schema.metadata or {}).get(b"tandem.table", b"").decode()
    schema = SCHEMAS[table_name] if table_name in SCHEMAS else tables[0].schema
    merged = dedupe(pa.concat_tables([conform(t, schema) for t in tables]))
    meta = dict(schema.metadata or {})
    meta.pop(b"tandem.entries", None)
    meta[b"tandem.part_id"] = f"c{digest}".encode()
    write_parquet_atomic(merged.replace_schema_metadata(meta), pdir / output, compression)
    finish_compactions(pdir)
    result.inputs = names
    result.output = output
    result.rows = merged.num_rows
    return result


def compact_tables(
    lake: Path,
    tables: Iterable[str],
    open_parts_of: Callable[[str], set[str]],
    min_age_s: float,
    compression: str,
    progress: Callable[[Path], None] | None = None,
) -> list[CompactResult]:
    """Compact every partition of ``tables`` under ``lake``, skipping each table's open parts; the
    partitions that merged something."""
    results = []
    for table in tables:
        tdir = lake / table
        if not tdir.is_dir():
            continue
        open_parts = open_parts_of(table)
        for pdir in sorted(tdir.glob("date=*/hour=*")):
            r = compact_partition(pdir, open_parts=open_parts, min_age_s=min_age_s, compression=compression)
            if progress is not None:
                progress(pdir)
            if r.inputs:
                results.append(r)
    return results
