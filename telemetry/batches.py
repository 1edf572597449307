"""Telemetry rows -> Arrow: one RecordBatch of a table's schema from Python dicts, and its Arrow IPC stream
bytes (the payload of one Redis Stream entry, ``telemetry.emitter``).

The fast form: timestamps given as epoch seconds go through one C++ pass over the dicts (the table as a
struct whose timestamps are float64), then are scaled to microseconds; rows with ``datetime`` values take
a slow path, column by column. Small batches (``SMALL_BATCH``, the common case of a router flushing every
few seconds) take the encodings that are cheaper for a few rows.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from telemetry.schemas import SCHEMAS, TIMESTAMP_FIELDS, TS

__all__ = ["SMALL_BATCH", "batch_to_ipc", "build_batch", "warm_batches"]


def _struct_type(table: str) -> pa.StructType:
    """The table's fields as one struct, timestamps as float64 epoch seconds (the fast input form)."""
    ts = TIMESTAMP_FIELDS[table]
    return pa.struct([pa.field(f.name, pa.float64() if f.name in ts else f.type) for f in SCHEMAS[table]])


_STRUCTS = {t: _struct_type(t) for t in SCHEMAS}

SMALL_BATCH = 64
"""Batches of at most this many rows take the encodings that are cheaper for a few rows (plain Python
timestamp conversion, no lz4): the common case for a router flushing every few seconds."""


def _fill(col: pa.Array, make: Any) -> pa.Array:
    """Replace the nulls of ``col`` by ``make(i)`` for each null position i."""
    if col.null_count == 0:
        return col
    vals = col.to_pylist()
    return pa.array([v if v is not None else make(i) for i, v in enumerate(vals)], type=col.type)


def warm_batches() -> None:
    """Build one batch of every table, so that what pyarrow loads on its first use (it imports pandas
    when it first converts Python rows: ~0.2 s of CPU) is loaded before a process serves, not in the
    middle of its first requests. Call once at startup, off the event loop."""
    for table in SCHEMAS:
        build_batch(table, [{}], [0.0], "warm")


def build_batch(
    table: str,
    records: list[Mapping[str, Any]],
    times: list[float],
    source: str,
    new_id: Any = lambda: uuid.uuid4().hex,
) -> pa.RecordBatch:
    """Rows -> one RecordBatch of ``table``'s schema. ``times`` gives each row's event_time when the
    record has none; ``new_id()`` gives event ids where missing. Unknown keys are ignored. Raises
    (TypeError, ValueError, ArrowException) when a value does not fit its column."""
    schema = SCHEMAS[table]
    ts_fields = TIMESTAMP_FIELDS[table]
    try:
        # One C++ pass over the dicts; works when timestamps are given as epoch seconds.
        st = pa.array(records, type=_STRUCTS[table])
        cols = st.flatten()
    except (pa.ArrowException, TypeError):
        cols = None
    arrays: list[pa.Array] = []
    for i, f in enumerate(schema):
        name = f.name
        if cols is not None:
            col = cols[i]
            if name in ts_fields:
                if name == "event_time":
                    col = _fill(col, lambda j: times[j])
                if len(records) <= SMALL_BATCH:
                    # Four compute kernels per column cost ~30 µs each whatever the length; a few
                    # rows are cheaper in Python. round() is half-to-even, as pc.round's default.
                    col = pa.array([None if v is None else round(v * 1e6) for v in col.to_pylist()], TS)
                else:
                    col = pc.cast(pc.round(pc.multiply(col, 1e6)), pa.int64()).cast(TS)
            elif name == "event_id":
                col = _fill(col, lambda j: new_id())
            elif name == "source":
                col = _fill(col, lambda j: source)
            arrays.append(col)
            continue
        # Slow path (datetimes among the timestamps): column by column.
        if name == "event_id":
            vals: list[Any] = [r.get("event_id") or new_id() for r in records]
        elif name == "event_time":
            vals = [r.get("event_time") or t for r, t in zip(records, times, strict=True)]
        elif name == "source":
            vals = [r.get("source") or source for r in records]
        else:
            vals = [r.get(name) for r in records]
        if name in ts_fields:
            arrays.append(pa.array([_one_ts(v) for v in vals], type=TS))
        else:
            arrays.append(pa.array(vals, type=f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _one_ts(v: Any) -> Any:
    if v is None or isinstance(v, datetime):
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return datetime.fromtimestamp(float(v), tz=UTC)
    raise TypeError(f"unsupported timestamp value {v!r}")


def batch_to_ipc(batch: pa.RecordBatch) -> bytes:
    """One RecordBatch as Arrow IPC stream bytes; lz4-compressed buffers unless the batch is small.

    A router under steady load flushes a row or two each time: lz4 then costs ten times the rest of
    the encoding (0.52 against 0.05 ms for two request rows) and makes the bytes larger (frame headers
    on some forty tiny buffers). Readers need no flag: IPC marks each message's compression."""
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression="lz4" if batch.num_rows > SMALL_BATCH else None)
    with pa.ipc.new_stream(sink, batch.schema, options=opts) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()
