"""``tandem trace from-lake``: the lake's ``requests`` table (``telemetry.schemas``) into a trace.

What the lake has, the trace keeps: arrival (``t_arrival``), lengths (``prompt_tokens``,
``completion_tokens``), the session, observed ``cached_tokens`` (what the client was told), and a
cancel time for requests whose ``status`` is ``cancelled`` (``t_finish - t_arrival``). A request's
parent is the previous request of its session (by arrival), and ``gap_s`` is its arrival minus the
parent's ``t_finish`` (null when the two overlapped: the turn did not wait for its parent).

What the lake does not have is the prompts' content, so the block hashes are *reconstructed*, and the
trace's notes say so: a session's first prompt is new content; a later turn's prompt is assumed to be
its parent's prompt, then the parent's answer, then new content (an agent appending to its context),
or, when it is shorter than that, a prefix of it (a context cut short). Requests of different sessions
share nothing. So the ceiling of such a trace counts within-session reuse only; the observed
``cached_tokens`` may be higher (system prompts shared across sessions) and ``stats`` prints both.

Rows with no ``prompt_tokens`` (rejected before tokenizing) are left out; ``where`` adds a DuckDB
condition on the table's columns (e.g. ``"t_arrival >= TIMESTAMP '2026-12-01 10:00'"``).
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from telemetry.query import query
from traces.hashing import Segment, TraceError, chain_segments
from traces.schema import Trace, TraceMeta, add_row, empty_columns, make_trace


def _prefix(segments: list[Segment], n: int) -> list[Segment]:
    out: list[Segment] = []
    for name, length in segments:
        if n <= 0:
            break
        out.append((name, min(length, n)))
        n -= length
    return out


def from_lake(lake: Path, *, block_tokens: int = 16, where: str | None = None) -> Trace:
    sql = (
        "SELECT request_id, session_id, epoch_us(t_arrival) AS arrival_us, epoch_us(t_finish) AS finish_us, "
        "prompt_tokens, completion_tokens, cached_tokens, status FROM requests "
        "WHERE prompt_tokens IS NOT NULL AND prompt_tokens > 0 AND t_arrival IS NOT NULL"
        + (f" AND ({where})" if where else "")
        + " ORDER BY t_arrival, request_id"
    )
    try:
        rows = query(lake, sql).to_pylist()
    except duckdb.Error as exc:
        raise TraceError(f"cannot read the lake's requests table at {lake}: {exc}") from exc
    if not rows:
        raise TraceError(f"no requests in the lake at {lake}" + (f" where {where}" if where else ""))
    t0 = rows[0]["arrival_us"]
    cols = empty_columns()
    # session -> (request id, turn, finish_us, the segments of its prompt and answer)
    last: dict[str, tuple[str, int, int | None, list[Segment]]] = {}
    for i, r in enumerate(rows):
        rid = r["request_id"] or f"lake-{i}"
        n_in, n_out = int(r["prompt_tokens"]), int(r["completion_tokens"] or 0)
        sid = r["session_id"]
        prev = last.get(sid) if sid is not None else None
        if prev is None:
            segments: list[Segment] = [(f"{rid}-prompt", n_in)]
            parent, turn, gap = None, 0, None
        else:
            parent, pturn, pfinish, context = prev
            turn = pturn + 1
            have = sum(n for _, n in context)
            segments = context + [(f"{rid}-new", n_in - have)] if n_in >= have else _prefix(context, n_in)
            gap_us = r["arrival_us"] - pfinish if pfinish is not None else None
            gap = gap_us / 1e6 if gap_us is not None and gap_us >= 0 else None
        if sid is not None:
            last[sid] = (rid, turn, r["finish_us"], segments + [(f"{rid}-answer", n_out)])
        cancelled = r["status"] == "cancelled" and r["finish_us"] is not None
        add_row(
            cols,
            request_id=rid,
            session_id=sid,
            parent_request_id=parent,
            turn=turn,
            arrival_s=(r["arrival_us"] - t0) / 1e6,
            gap_s=gap,
            input_tokens=n_in,
            output_tokens=n_out,
            block_hashes=chain_segments(segments, block_tokens),
            cached_tokens=r["cached_tokens"],
            cancel_after_s=(r["finish_us"] - r["arrival_us"]) / 1e6 if cancelled else None,
        )
    notes = (
        "block hashes reconstructed (the lake has no prompt content): a turn extends its parent's prompt "
        "and answer; sessions share nothing"
    )
    return make_trace(cols, TraceMeta(block_tokens, f"lake:{lake}", notes))
