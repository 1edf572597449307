"""Where examples come from: the session store's turns joined with the lake's request and feedback rows.

A *turn* (``tandem_turns``: tenant_id, session_id, turn_id = the request id, created_at, body = the JSON
of the router's ``Turn``) holds the messages the turn added and the assistant's response. The export
rebuilds what the model saw when it answered: the session's earlier turns as served, then the turn's
own messages. A turn whose first message equals the session's first message (and that is not the
session's first turn) was sent as a whole history of its own (the client rewrote, trimmed or
regenerated it; ``router.sessions.models.new_messages`` then stores the whole request): its context is
its own messages alone. The router reads the ``Turn`` type above the telemetry layer, so its JSON is read
here as plain data, by the field names that type writes.

The lake adds, per request id (one row each: the latest, should a row arrive twice): the outcome
(status, finish_reason), timings, token counts and the hit figures; and per response id the latest
feedback (rating, comment, labels, when). A turn with no lake row yet (telemetry dropped it, or the
lake writer is behind) keeps its messages and gets empty metadata.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from telemetry.export.db import ExportDb
from telemetry.query import connect

Message = dict[str, Any]

LAKE_FIELDS = (
    "status",
    "finish_reason",
    "requested_model",
    "endpoint",
    "stream",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_s",
    "itl_mean_s",
    "e2e_s",
    "fleet_cached_tokens",
    "routed_cached_tokens",
    "engine_cached_tokens",
    "num_tool_calls",
    "routing_decision",
    "prefill_node",
    "decode_node",
    "error_type",
)
"""The request row's columns an example carries as metadata."""

_CHUNK = 500


@dataclass(frozen=True, slots=True)
class Feedback:
    rating: int | None
    comment: str | None
    labels: list[str]
    at: float
    """When it was given (Unix seconds)."""


@dataclass(frozen=True, slots=True)
class Example:
    """One served turn with what the model saw, what it answered and what the lake knows of it."""

    tenant_id: str
    session_id: str
    request_id: str
    turn_index: int
    created_at: float
    model: str | None
    context: list[Message]
    response: Message | None
    lake: dict[str, Any] = field(default_factory=dict)
    feedback: Feedback | None = None

    @property
    def position(self) -> tuple[float, str, str, str]:
        return (self.created_at, self.tenant_id, self.session_id, self.request_id)

    @property
    def status(self) -> str | None:
        """The request's outcome per the lake (ok, error, cancelled, ...); None when the lake has no row."""
        value = self.lake.get("status")
        return None if value is None else str(value)


@dataclass(frozen=True, slots=True)
class TurnRow:
    tenant_id: str
    session_id: str
    turn_id: str
    created_at: float
    body: dict[str, Any]


_SELECT = "SELECT tenant_id, session_id, turn_id, created_at, body FROM tandem_turns"
_ORDER = " ORDER BY tenant_id, session_id, created_at, turn_id"


def sessions_with_turns_between(db: ExportDb, after: float, until: float) -> list[TurnRow]:
    """Every turn (up to ``until``) of the sessions that have a turn in ``[after, until]``."""
    if not db.has_table("tandem_turns"):
        return []
    sql = (
        f"{_SELECT} t WHERE created_at <= $2 AND EXISTS (SELECT 1 FROM tandem_turns n WHERE "
        "n.tenant_id = t.tenant_id AND n.session_id = t.session_id AND n.created_at >= $1 AND n.created_at <= $2)"
    )
    return _rows(db.fetch(sql + _ORDER, after, until))


def nth_turn_end(db: ExportDb, after: float, until: float, n: int) -> float | None:
    """The end time of the ``n``-th turn (from 1) ending in ``(after, until]``; None if there are fewer."""
    if not db.has_table("tandem_turns"):
        return None
    rows = db.fetch(
        "SELECT created_at FROM tandem_turns WHERE created_at > $1 AND created_at <= $2 "
        "ORDER BY created_at LIMIT 1 OFFSET $3",
        after,
        until,
        n - 1,
    )
    return float(rows[0][0]) if rows else None


def sessions_of_turns(db: ExportDb, turn_ids: Iterable[str]) -> list[TurnRow]:
    """Every turn of the sessions that hold one of ``turn_ids``."""
    ids = sorted(set(turn_ids))
    if not ids or not db.has_table("tandem_turns"):
        return []
    seen: dict[tuple[str, str, str], TurnRow] = {}
    for i in range(0, len(ids), _CHUNK):
        chunk = ids[i : i + _CHUNK]
        marks = ", ".join(f"${k + 1}" for k in range(len(chunk)))
        sql = (
            f"{_SELECT} t WHERE EXISTS (SELECT 1 FROM tandem_turns n WHERE n.tenant_id = t.tenant_id "
            f"AND n.session_id = t.session_id AND n.turn_id IN ({marks}))"
        )
        for row in _rows(db.fetch(sql + _ORDER, *chunk)):
            seen[(row.tenant_id, row.session_id, row.turn_id)] = row
    return sorted(seen.values(), key=lambda r: (r.tenant_id, r.session_id, r.created_at, r.turn_id))


def _rows(raw: Sequence[tuple[Any, ...]]) -> list[TurnRow]:
    return [TurnRow(str(t), str(s), str(i), float(c), json.loads(b)) for t, s, i, c, b in raw]


def build_examples(turns: Sequence[TurnRow]) -> list[Example]:
    """One example per turn, its context rebuilt from the session's earlier turns (see the docstring).
    ``turns`` must be grouped by session and ordered within it (as the readers above return them)."""
    out: list[Example] = []
    served: list[Message] = []
    first: Message | None = None
    key: tuple[str, str] | None = None
    index = 0
    for row in turns:
        if (row.tenant_id, row.session_id) != key:
            key, served, first, index = (row.tenant_id, row.session_id), [], None, 0
        own: list[Message] = list(row.body.get("messages") or [])
        response: Message | None = row.body.get("response")
        whole = index > 0 and bool(own) and own[0] == first
        context = own if whole else [*served, *own]
        if first is None and own:
            first = own[0]
        out.append(
            Example(
                tenant_id=row.tenant_id,
                session_id=row.session_id,
                request_id=row.turn_id,
                turn_index=index,
                created_at=row.created_at,
                model=row.body.get("model"),
                context=context,
                response=response,
            )
        )
        served = [*context, *([response] if response else [])]
        index += 1
    return out


def _epoch(value: Any) -> Any:
    return value.timestamp() if hasattr(value, "timestamp") else value


def join_lake(examples: Sequence[Example], lake: Path | None) -> list[Example]:
    """``examples`` with their request rows and latest feedback from the lake (when it exists)."""
    if lake is None or not lake.is_dir() or not examples:
        return list(examples)
    con = connect(lake)
    try:
        con.register("_ids", pa.table({"id": [e.request_id for e in examples]}))
        cols = ", ".join(LAKE_FIELDS)
        requests = con.execute(
            f"""SELECT request_id, {cols} FROM requests WHERE request_id IN (SELECT id FROM _ids)
                QUALIFY row_number() OVER (PARTITION BY request_id ORDER BY event_time DESC, event_id DESC) = 1"""
        ).fetchall()
        feedback = con.execute(
            """SELECT coalesce(request_id, response_id), rating, comment, labels, epoch(event_time) FROM feedback
               WHERE coalesce(request_id, response_id) IN (SELECT id FROM _ids)
               QUALIFY row_number() OVER (PARTITION BY response_id ORDER BY event_time DESC, event_id DESC) = 1"""
        ).fetchall()
    finally:
        con.close()
    by_id = {r[0]: {k: _epoch(v) for k, v in zip(LAKE_FIELDS, r[1:], strict=True)} for r in requests}
    fb = {r[0]: Feedback(r[1], r[2], list(r[3] or []), float(r[4])) for r in feedback}
    return [replace(e, lake=by_id.get(e.request_id, {}), feedback=fb.get(e.request_id)) for e in examples]


def rated_request_ids(lake: Path | None, until: float) -> list[str]:
    """Request ids with feedback given up to ``until`` (Unix seconds)."""
    if lake is None or not lake.is_dir():
        return []
    con = connect(lake)
    try:
        rows = con.execute(
            "SELECT DISTINCT coalesce(request_id, response_id) FROM feedback WHERE epoch(event_time) <= ?", [until]
        ).fetchall()
    finally:
        con.close()
    return [str(r[0]) for r in rows if r[0] is not None]
