"""A replay's results: one Parquet row per request, and the summary ``tandem replay`` prints.

    request_id, session_id, turn      from the trace
    scheduled_s, sent_s, end_s        seconds from the replay's start: when the plan said to send it,
                                      when it was sent, when its answer ended (or failed)
    ttft_s                            sent to the first chunk with text (null: none came)
    itl_s                             the gaps between text chunks, seconds (list)
    itl_mean_s, itl_p50_s, itl_p99_s  of those gaps (null with fewer than two chunks)
    prompt_tokens_sent, max_tokens    what was asked (after rescaling)
    prompt_tokens, completion_tokens, cached_tokens   the server's ``usage`` (cached: its
                                      ``prompt_tokens_details.cached_tokens``), null if it sent none
    ceiling_tokens                    prompt tokens an infinite prefix cache would have hit (plan.py)
    status, http_status, error        ok | error | cancelled, and why

File metadata: ``tandem.replay.schema_version`` (1), the trace's source, the URL, mode, speed and the
rescaling (``tandem.replay.scaling``).

Hit rates in the summary: observed = cached tokens / prompt tokens over the requests that ended ok
(the server's own counts); ceiling = ceiling tokens / prompt tokens sent over the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from replay.runner import Result
from traces.figures import RunFigures

SCHEMA_VERSION = 1

RESULT_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string()),
        pa.field("turn", pa.int32()),
        pa.field("scheduled_s", pa.float64()),
        pa.field("sent_s", pa.float64()),
        pa.field("end_s", pa.float64()),
        pa.field("ttft_s", pa.float64()),
        pa.field("itl_s", pa.list_(pa.float64())),
        pa.field("itl_mean_s", pa.float64()),
        pa.field("itl_p50_s", pa.float64()),
        pa.field("itl_p99_s", pa.float64()),
        pa.field("prompt_tokens_sent", pa.int64()),
        pa.field("max_tokens", pa.int64()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("completion_tokens", pa.int64()),
        pa.field("cached_tokens", pa.int64()),
        pa.field("ceiling_tokens", pa.int64()),
        pa.field("status", pa.string()),
        pa.field("http_status", pa.int64()),
        pa.field("error", pa.string()),
    ]
)


def to_table(results: list[Result]) -> pa.Table:
    rows = []
    for r in results:
        o, p = r.outcome, r.planned
        gaps = np.diff(o.chunk_times).tolist() if len(o.chunk_times) > 1 else []
        rows.append(
            {
                "request_id": p.request_id,
                "session_id": p.session_id,
                "turn": p.turn,
                "scheduled_s": r.scheduled_s,
                "sent_s": o.sent - r.t0,
                "end_s": o.end - r.t0,
                "ttft_s": o.chunk_times[0] - o.sent if o.chunk_times else None,
                "itl_s": gaps,
                "itl_mean_s": float(np.mean(gaps)) if gaps else None,
                "itl_p50_s": float(np.percentile(gaps, 50)) if gaps else None,
                "itl_p99_s": float(np.percentile(gaps, 99)) if gaps else None,
                "prompt_tokens_sent": len(p.prompt),
                "max_tokens": p.max_tokens,
                "prompt_tokens": o.prompt_tokens,
                "completion_tokens": o.completion_tokens,
                "cached_tokens": o.cached_tokens,
                "ceiling_tokens": p.ceiling_tokens,
                "status": o.status,
                "http_status": o.http_status,
                "error": o.error,
            }
        )
    return pa.Table.from_pylist(rows, schema=RESULT_SCHEMA)


def write_results(table: pa.Table, path: Path, meta: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    md = {b"tandem.replay.schema_version": str(SCHEMA_VERSION).encode()}
    md.update({f"tandem.replay.{k}".encode(): v.encode() for k, v in meta.items()})
    pq.write_table(table.replace_schema_metadata(md), path)


@dataclass(frozen=True, kw_only=True)
class Summary(RunFigures):
    requests: int
    ok: int
    errors: int
    cancelled: int
    ceiling_hit: float


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(table: pa.Table) -> Summary:
    rows = table.to_pylist()
    ok = [r for r in rows if r["status"] == "ok"]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    itl = [g for r in ok for g in r["itl_s"]]
    prompt = sum(r["prompt_tokens"] or r["prompt_tokens_sent"] for r in ok)
    sent = sum(r["prompt_tokens_sent"] for r in ok)
    wall = max((r["end_s"] for r in rows), default=0.0) - min((r["sent_s"] for r in rows), default=0.0)
    return Summary(
        requests=len(rows),
        ok=len(ok),
        errors=sum(r["status"] == "error" for r in rows),
        cancelled=sum(r["status"] == "cancelled" for r in rows),
        wall_s=wall,
        ttft_p50_s=_pct(ttft, 50),
        ttft_p90_s=_pct(ttft, 90),
        ttft_p99_s=_pct(ttft, 99),
        itl_p50_s=_pct(itl, 50),
        itl_p90_s=_pct(itl, 90),
        output_tok_s=sum(r["completion_tokens"] or 0 for r in ok) / wall if wall > 0 else float("nan"),
        observed_hit=sum(r["cached_tokens"] or 0 for r in ok) / prompt if prompt else float("nan"),
        ceiling_hit=sum(r["ceiling_tokens"] for r in ok) / sent if sent else float("nan"),
    )


def render(s: Summary) -> str:
    return "\n".join(
        [
            f"requests     {s.requests}  ok {s.ok}  errors {s.errors}  cancelled {s.cancelled}  wall {s.wall_s:.1f} s",
            f"TTFT         p50 {s.ttft_p50_s * 1e3:.1f} ms  p90 {s.ttft_p90_s * 1e3:.1f} ms  "
            f"p99 {s.ttft_p99_s * 1e3:.1f} ms",
            f"ITL          p50 {s.itl_p50_s * 1e3:.1f} ms  p90 {s.itl_p90_s * 1e3:.1f} ms",
            f"throughput   {s.output_tok_s:.1f} output tok/s",
            f"cache hits   observed {s.observed_hit:.1%} of prompt tokens  |  trace ceiling {s.ceiling_hit:.1%} "
            "(infinite prefix cache, same requests)",
        ]
    )
