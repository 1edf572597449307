"""The trace format: one Parquet file, one row per request, a versioned Arrow schema.

    request_id         string   unique within the trace
    session_id         string   the conversation or agent session (null: none known)
    parent_request_id  string   the previous turn of the session (null: first turn, or none known)
    turn               int32    0 for a session's first request, then 1, 2, ...
    arrival_s          float64  arrival, seconds from the trace's start (rows sorted by it)
    gap_s              float64  time between the parent's end (last token) and this arrival: the user's
                                think time or the agent's tool time. Null when not recorded (Mooncake
                                records no service times); a replay then keeps the recorded spacing
                                of arrivals instead (``replay``'s docstring)
    input_tokens       int64    prompt tokens
    output_tokens      int64    completion tokens
    block_hashes       list<uint64>  chained hashes of the prompt's base blocks (``block_tokens`` each,
                                the last one possibly partial): ``traces.hashing`` says how they are
                                made and regrouped into any other block size
    cached_tokens      int64    prompt tokens the serving system reported cached (null: not observed)
    cancel_after_s     float64  the client went away this long after arrival (null: it did not)

File metadata (Parquet key-value): ``tandem.trace.schema_version``, ``tandem.trace.block_tokens`` (the
base block size of ``block_hashes``), ``tandem.trace.source`` (what it was made from, e.g.
``mooncake:conversation_trace.jsonl`` or ``synth:agentic seed=1``) and ``tandem.trace.notes`` (what
the importer had to assume).

Versions (bump ``SCHEMA_VERSION`` on any change; add nullable columns only, never rename or retype):

    1  first version (this file).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from traces.hashing import TraceError

SCHEMA_VERSION = 1

_META_VERSION = b"tandem.trace.schema_version"
_META_BLOCK = b"tandem.trace.block_tokens"
_META_SOURCE = b"tandem.trace.source"
_META_NOTES = b"tandem.trace.notes"


def _f(name: str, typ: pa.DataType, doc: str, *, nullable: bool = True) -> pa.Field:
    return pa.field(name, typ, nullable=nullable, metadata={"doc": doc})


TRACE_SCHEMA = pa.schema(
    [
        _f("request_id", pa.string(), "Unique within the trace.", nullable=False),
        _f("session_id", pa.string(), "Session (conversation, agent run); null if none known."),
        _f("parent_request_id", pa.string(), "Previous turn of the session; null for a first turn."),
        _f("turn", pa.int32(), "Turn within the session, from 0.", nullable=False),
        _f("arrival_s", pa.float64(), "Arrival, seconds from the trace's start.", nullable=False),
        _f("gap_s", pa.float64(), "Parent's end to this arrival (think or tool time), seconds; null: unknown."),
        _f("input_tokens", pa.int64(), "Prompt tokens.", nullable=False),
        _f("output_tokens", pa.int64(), "Completion tokens.", nullable=False),
        _f(
            "block_hashes",
            pa.list_(pa.uint64()),
            "Chained hashes of the prompt's base blocks (traces.hashing).",
            nullable=False,
        ),
        _f("cached_tokens", pa.int64(), "Prompt tokens reported cached when recorded; null: not observed."),
        _f("cancel_after_s", pa.float64(), "Client left this long after arrival; null: it did not."),
    ]
)


@dataclass(frozen=True)
class TraceMeta:
    block_tokens: int
    """Tokens per base block of ``block_hashes``."""
    source: str
    """What the trace was made from."""
    notes: str = ""
    """What the importer had to assume (printed by ``tandem trace stats``)."""


@dataclass(frozen=True)
class Trace:
    table: pa.Table
    """Rows in arrival order, exactly ``TRACE_SCHEMA``."""
    meta: TraceMeta

    def __len__(self) -> int:
        return int(self.table.num_rows)


def empty_columns() -> dict[str, list[object]]:
    """One empty list per trace column, in schema order: what importers fill before ``make_trace``."""
    return {name: [] for name in TRACE_SCHEMA.names}


def add_row(
    columns: dict[str, list[object]],
    *,
    request_id: str,
    session_id: str | None,
    parent_request_id: str | None,
    turn: int,
    arrival_s: float,
    input_tokens: int,
    output_tokens: int,
    block_hashes: list[int],
    gap_s: float | None = None,
    cached_tokens: int | None = None,
    cancel_after_s: float | None = None,
) -> None:
    """Append one request to ``empty_columns()``-shaped columns: every column once, by name, so an
    importer cannot leave one a row short. The optional ones are null when the source does not know."""
    row = locals()
    for name in TRACE_SCHEMA.names:
        columns[name].append(row[name])


def make_trace(columns: dict[str, list[object]], meta: TraceMeta) -> Trace:
    """A trace from plain columns (every column of ``TRACE_SCHEMA``), checked and sorted by arrival."""
    missing = [f.name for f in TRACE_SCHEMA if f.name not in columns]
    if missing:
        raise TraceError(f"trace columns missing: {missing}")
    table = pa.table({f.name: pa.array(columns[f.name], f.type) for f in TRACE_SCHEMA}, schema=TRACE_SCHEMA)
    table = table.sort_by([("arrival_s", "ascending")])
    trace = Trace(table, meta)
    validate(trace)
    return trace


def validate(trace: Trace) -> None:
    """Raise ``TraceError`` naming the first rule a trace breaks."""
    t, meta = trace.table, trace.meta
    if t.num_rows == 0:
        raise TraceError("a trace needs at least one request")
    if meta.block_tokens <= 0:
        raise TraceError(f"block_tokens must be positive, got {meta.block_tokens}")
    ids = t.column("request_id").to_pylist()
    if len(set(ids)) != len(ids):
        raise TraceError("request_id values are not unique")
    known = set(ids)
    inputs = t.column("input_tokens").to_pylist()
    outputs = t.column("output_tokens").to_pylist()
    lens = [len(h) for h in t.column("block_hashes").to_pylist()]
    for rid, n_in, n_out, n_blocks, parent in zip(
        ids, inputs, outputs, lens, t.column("parent_request_id").to_pylist(), strict=True
    ):
        if n_in <= 0 or n_out < 0:
            raise TraceError(f"request {rid}: input_tokens must be > 0 and output_tokens >= 0 ({n_in}, {n_out})")
        want = -(-n_in // meta.block_tokens)
        if n_blocks != want:
            raise TraceError(
                f"request {rid}: {n_blocks} block hashes for {n_in} tokens at {meta.block_tokens} per block "
                f"(expected {want})"
            )
        if parent is not None and parent not in known:
            raise TraceError(f"request {rid}: parent {parent} is not in the trace")


def write_trace(trace: Trace, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        _META_VERSION: str(SCHEMA_VERSION).encode(),
        _META_BLOCK: str(trace.meta.block_tokens).encode(),
        _META_SOURCE: trace.meta.source.encode(),
        _META_NOTES: trace.meta.notes.encode(),
    }
    pq.write_table(trace.table.replace_schema_metadata(meta), path, compression="zstd")


def read_trace(path: Path) -> Trace:
    """A trace file, checked: its schema version, its columns, its rows (``validate``)."""
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise TraceError(f"{path}: not a readable Parquet file ({exc})") from exc
    md = table.schema.metadata or {}
    if _META_VERSION not in md:
        raise TraceError(f"{path}: not a Tandem trace (no {_META_VERSION.decode()} in its metadata)")
    version = int(md[_META_VERSION])
    if version > SCHEMA_VERSION:
        raise TraceError(f"{path}: trace schema version {version} is newer than this Tandem's ({SCHEMA_VERSION})")
    missing = [f.name for f in TRACE_SCHEMA if f.name not in table.column_names]
    if missing:
        raise TraceError(f"{path}: trace columns missing: {missing}")
    try:
        table = table.select([f.name for f in TRACE_SCHEMA]).cast(TRACE_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise TraceError(f"{path}: trace columns of the wrong type ({exc})") from exc
    meta = TraceMeta(
        block_tokens=int(md.get(_META_BLOCK, b"0")),
        source=md.get(_META_SOURCE, b"").decode(),
        notes=md.get(_META_NOTES, b"").decode(),
    )
    trace = Trace(table.sort_by([("arrival_s", "ascending")]), meta)
    validate(trace)
    return trace
