"""Telemetry benchmark, half (a): lake-writer throughput from a pre-filled stream.

``run_events_throughput(redis_url, n_events, out)`` fills a fresh ``requests`` stream with
``n_events`` realistic request records in emitter-sized batches (Arrow IPC, as the Emitter writes
them), then times one ``LakeWriter.drain()`` of it into a temporary lake: decode, conform, de-dupe
check, partition, Parquet (zstd) with fsync and rename, XACK/XDEL. It checks that the lake holds exactly
``n_events`` rows, removes its stream and keys, and returns (and writes to ``out`` as JSON when given)
``{"events_per_s": ..., ...}``. Half (b), router TTFT with telemetry on vs off, needs the router and is
added by ``tandem bench telemetry``.

    python -m bench.telemetry --events 200000    # Redis: $TANDEM_REDIS_URL's server, database 3
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import redis
from prometheus_client import CollectorRegistry

from contracts.config import redis_url as configured_redis_url
from telemetry.batches import batch_to_ipc, build_batch
from telemetry.emitter import stream_key
from telemetry.lake_writer import LakeWriter, WriterConfig
from telemetry.metrics import TandemMetrics
from telemetry.query import query
from telemetry.schemas import SCHEMA_VERSION


def sample_request(i: int, now: float, rng: random.Random) -> dict[str, Any]:
    """A plausible ``requests`` record (every field the router fills)."""
    prompt = rng.randint(200, 6000)
    fleet = rng.randint(0, prompt)
    routed = rng.randint(0, fleet)
    engine = rng.randint(0, routed)
    ttft = rng.uniform(0.05, 1.5)
    e2e = ttft + rng.uniform(0.2, 8.0)
    t0 = now - e2e
    return {
        "request_id": f"req-{i}",
        "response_id": f"chatcmpl-{i}",
        "session_id": f"sess-{i % 500}",
        "tenant_id": f"tenant-{i % 7}",
        "model": "smollm2-135m",
        "endpoint": "chat",
        "stream": bool(i % 2),
        "prefill_node": f"prefill-{i % 4}",
        "decode_node": f"decode-{i % 2}",
        "t_arrival": t0,
        "t_routed": t0 + 0.001,
        "t_prefill_start": t0 + 0.002,
        "t_prefill_end": t0 + ttft * 0.7,
        "t_transfer_start": t0 + ttft * 0.7,
        "t_transfer_end": t0 + ttft * 0.9,
        "t_first_token": t0 + ttft,
        "t_finish": now,
        "ttft_s": ttft,
        "itl_mean_s": rng.uniform(0.01, 0.05),
        "itl_p99_s": rng.uniform(0.05, 0.2),
        "e2e_s": e2e,
        "prompt_tokens": prompt,
        "completion_tokens": rng.randint(1, 512),
        "cached_tokens": engine,
        "routing_policy": "cache_aware",
        "routing_decision": "pd",
        "routing_reason": "best_prefix",
        "fleet_cached_tokens": fleet,
        "routed_cached_tokens": routed,
        "engine_cached_tokens": engine,
        "transfer_bytes": (prompt - engine) * 23040,
        "transfer_s": ttft * 0.2,
        "kv_connector": "tandem",
        "num_tool_calls": i % 3,
        "finish_reason": "stop",
        "status": "ok",
        "http_status": 200,
    }


def prefill_stream(r: redis.Redis, stream: str, n_events: int, batch_rows: int) -> int:
    """XADD ``n_events`` request rows in entries of ``batch_rows``; returns entries added."""
    rng = random.Random(7)
    now = time.time()
    template = build_batch(
        "requests", [sample_request(i, now, rng) for i in range(batch_rows)], [now] * batch_rows, "bench"
    )
    entries = 0
    left = n_events
    pipe = r.pipeline(transaction=False)
    while left > 0:
        n = min(batch_rows, left)
        prefix = uuid.uuid4().hex[:16]
        ids = pa.array([f"{prefix}{j:08x}" for j in range(n)])
        batch = template.slice(0, n).set_column(0, "event_id", ids)
        pipe.xadd(stream, {"v": SCHEMA_VERSION, "n": n, "src": "bench", "a": batch_to_ipc(batch)})
        entries += 1
        left -= n
        if entries % 50 == 0:
            pipe.execute()
    pipe.execute()
    return entries


def run_events_throughput(
    redis_url: str,
    n_events: int = 200_000,
    out: Path | None = None,
    *,
    batch_rows: int = 2000,
    batch_entries: int = 64,
    compression: str = "zstd",
) -> dict[str, Any]:
    """Lake-writer throughput in request events/s from a pre-filled stream (see module docstring)."""
    prefix = f"tandem:bench:{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(redis_url)
    lake = Path(tempfile.mkdtemp(prefix="tandem-bench-lake-"))
    writer = LakeWriter(
        WriterConfig(
            lake=lake,
            redis_url=redis_url,
            stream_prefix=prefix,
            group="bench",
            consumer="bench-0",
            tables=("requests",),
            batch_entries=batch_entries,
            compression=compression,
        ),
        metrics=TandemMetrics(CollectorRegistry()),
    )
    try:
        stream = stream_key(prefix, "requests")
        entries = prefill_stream(r, stream, n_events, batch_rows)
        writer.ensure_groups()
        t0 = time.perf_counter()
        stats = writer.drain()
        elapsed = time.perf_counter() - t0
        rows_in_lake = query(lake, "SELECT count(*) AS n, count(DISTINCT event_id) AS d FROM requests").to_pylist()[0]
        result = {
            "events": n_events,
            "entries": entries,
            "batch_rows": batch_rows,
            "batch_entries": batch_entries,
            "compression": compression,
            "files": stats.files,
            "seconds": round(elapsed, 3),
            "events_per_s": round(stats.rows / elapsed),
            "lake_rows": rows_in_lake["n"],
            "lake_distinct_event_ids": rows_in_lake["d"],
            "lake_bytes": sum(p.stat().st_size for p in lake.rglob("*.parquet")),
            "exact": rows_in_lake["n"] == n_events == rows_in_lake["d"],
        }
    finally:
        writer.close()
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)
        r.close()
        shutil.rmtree(lake, ignore_errors=True)
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default=configured_redis_url(db=3))
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--batch-rows", type=int, default=2000)
    ap.add_argument("--batch-entries", type=int, default=64)
    ap.add_argument("--compression", default="zstd")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    res = run_events_throughput(
        a.redis_url,
        a.events,
        a.out,
        batch_rows=a.batch_rows,
        batch_entries=a.batch_entries,
        compression=a.compression,
    )
    print(json.dumps(res))
    print(f"RESULT events_per_s={res['events_per_s']}")


if __name__ == "__main__":
    main()
