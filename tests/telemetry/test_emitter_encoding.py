"""The emitter encodes a few rows and many rows by different means (``SMALL_BATCH``): both must give
the same columns, the same microsecond timestamps, and IPC bytes that read back to the same table."""

from __future__ import annotations

import pyarrow as pa
import pytest

from telemetry.batches import SMALL_BATCH, batch_to_ipc, build_batch

BASE = 1_764_590_000.0


def _rows(n: int) -> list[dict[str, object]]:
    # Fractions that sit on a half microsecond test the rounding rule, not only the conversion.
    return [
        {
            "event_id": f"e{i}",
            "request_id": f"r{i}",
            "t_arrival": BASE + i + 0.0000025,
            "t_first_token": None if i % 3 == 0 else BASE + i + 0.25,
            "t_finish": BASE + i + 1.123456789,
            "prompt_tokens": i,
        }
        for i in range(n)
    ]


def _read(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(data).read_all()


@pytest.mark.parametrize("n", [1, SMALL_BATCH, SMALL_BATCH + 1, 500])
def test_small_and_large_batches_encode_identically(n: int) -> None:
    rows = _rows(n)
    times = [BASE] * n
    batch = build_batch("requests", rows, times, "src")
    table = _read(batch_to_ipc(batch))
    assert table.num_rows == n
    # Row by row (always the small path) must agree with the batch, whichever path the batch took.
    for i in (0, n // 2, n - 1):
        one = build_batch("requests", [rows[i]], [BASE], "src")
        for name in ("t_arrival", "t_first_token", "t_finish", "event_time", "request_id", "prompt_tokens"):
            assert one.column(name)[0].as_py() == table.column(name)[i].as_py(), (name, i)
    finish = table.column("t_finish").cast(pa.int64()).to_pylist()
    assert finish[0] == round((BASE + 1.123456789) * 1e6)
    assert table.column("t_first_token").null_count == len(range(0, n, 3))


def _uncompressed(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression=None)) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def test_only_large_batches_are_compressed() -> None:
    small = build_batch("requests", _rows(2), [BASE] * 2, "src")
    large = build_batch("requests", _rows(500), [BASE] * 500, "src")
    assert batch_to_ipc(small) == _uncompressed(small)
    assert len(batch_to_ipc(large)) < len(_uncompressed(large)) / 2
    assert _read(batch_to_ipc(large)).equals(pa.Table.from_batches([large]))
