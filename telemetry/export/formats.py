"""The three shapes an export writes, all built from one *record* per served turn:
``{"messages": [...context..., response], "metadata": {...}}`` (what the redaction hook sees).

chat-jsonl
    One line per turn in OpenAI's chat fine-tuning shape: ``{"messages": [...], "metadata": {...}}``.
    ``messages`` is what the model saw (system, user, assistant with ``tool_calls``, ``tool`` results
    with ``tool_call_id``), then its answer. Every assistant message carries ``weight``: 1 on the answer
    this line is about, 0 on the earlier ones (each was the answer of its own line), so a training run
    over the whole export learns each served answer once.
preference-jsonl
    One line per rated pair in OpenAI's preference (DPO) shape: ``{"input": {"messages": [...]},
    "preferred_output": [answer], "non_preferred_output": [answer], "metadata": {"chosen": ...,
    "rejected": ...}}``. Two answers pair when they answer the same context of the same tenant and
    carry different ratings; the higher rating is chosen. ``PairRule.ALL`` pairs every such two;
    ``PairRule.EXTREMES`` only the best and the worst of each context.
parquet
    One row per turn: ids, ``messages`` as a list of structs (``content`` text; a content-part list is
    its JSON text), ``weight`` as above, and the metadata as flat columns (``SCHEMA``). Hugging Face
    ``datasets.load_dataset("parquet", data_files=...)`` reads it as it is.

Metadata (every format): request_id, session_id, tenant_id, turn_index, created_at (Unix seconds),
model, failed (the lake says error/cancelled), the request row's fields (``source.LAKE_FIELDS``: status,
finish_reason, timings, tokens, hit figures, nodes) and the latest feedback (rating, feedback_comment,
feedback_labels, feedback_at).
"""

from __future__ import annotations

import enum
import io
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from telemetry.export.filters import is_failed
from telemetry.export.redact import Record
from telemetry.export.source import LAKE_FIELDS, Example
from telemetry.schemas import SCHEMAS


class Format(enum.StrEnum):
    CHAT_JSONL = "chat-jsonl"
    PREFERENCE_JSONL = "preference-jsonl"
    PARQUET = "parquet"

    @property
    def extension(self) -> str:
        return "parquet" if self is Format.PARQUET else "jsonl"


class PairRule(enum.StrEnum):
    ALL = "all"
    EXTREMES = "extremes"


@dataclass(frozen=True, slots=True)
class Rated:
    example: Example
    record: Record
    rating: int
    at: float


def metadata(ex: Example) -> dict[str, Any]:
    fb = ex.feedback
    return {
        "request_id": ex.request_id,
        "session_id": ex.session_id,
        "tenant_id": ex.tenant_id,
        "turn_index": ex.turn_index,
        "created_at": ex.created_at,
        "model": ex.model,
        "failed": is_failed(ex),
        **{k: ex.lake.get(k) for k in LAKE_FIELDS},
        "rating": fb.rating if fb else None,
        "feedback_comment": fb.comment if fb else None,
        "feedback_labels": fb.labels if fb else None,
        "feedback_at": fb.at if fb else None,
    }


def record(ex: Example) -> Record:
    return {"messages": [*ex.context, *([ex.response] if ex.response else [])], "metadata": metadata(ex)}


def _weighted(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    last = len(messages) - 1
    return [
        {**m, "weight": int(i == last)} if m.get("role") == "assistant" else dict(m) for i, m in enumerate(messages)
    ]


def chat_line(rec: Record) -> dict[str, Any]:
    return {"messages": _weighted(rec["messages"]), "metadata": rec["metadata"]}


def pairs(rated: Sequence[tuple[Example, Record]], rule: PairRule) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Preference pairs of rated answers to one context, each with its position (the later of the two
    feedback times, then the chosen and rejected request ids)."""
    groups: dict[tuple[str, str], list[Rated]] = defaultdict(list)
    for ex, rec in rated:
        if ex.feedback is None or ex.feedback.rating is None or ex.response is None:
            continue
        key = (ex.tenant_id, json.dumps(ex.context, sort_keys=True))
        groups[key].append(Rated(ex, rec, ex.feedback.rating, ex.feedback.at))
    out: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    for members in groups.values():
        members.sort(key=lambda m: (m.example.created_at, m.example.request_id))
        if rule is PairRule.EXTREMES:
            candidates = [(max(members, key=lambda m: m.rating), min(members, key=lambda m: m.rating))]
        else:
            candidates = [(a, b) for i, a in enumerate(members) for b in members[i + 1 :]]
        for a, b in candidates:
            if a.rating == b.rating:
                continue
            chosen, rejected = (a, b) if a.rating > b.rating else (b, a)
            line = {
                "input": {"messages": chosen.record["messages"][:-1]},
                "preferred_output": chosen.record["messages"][-1:],
                "non_preferred_output": rejected.record["messages"][-1:],
                "metadata": {
                    "tenant_id": chosen.example.tenant_id,
                    "model": chosen.example.model,
                    "chosen": chosen.record["metadata"],
                    "rejected": rejected.record["metadata"],
                },
            }
            position = (max(chosen.at, rejected.at), chosen.example.request_id, rejected.example.request_id)
            out.append((position, line))
    return out


_CALL = pa.struct(
    [
        pa.field("id", pa.string()),
        pa.field("type", pa.string()),
        pa.field("function", pa.struct([pa.field("name", pa.string()), pa.field("arguments", pa.string())])),
    ]
)
MESSAGE = pa.struct(
    [
        pa.field("role", pa.string()),
        pa.field("content", pa.string()),
        pa.field("name", pa.string()),
        pa.field("tool_call_id", pa.string()),
        pa.field("tool_calls", pa.list_(_CALL)),
        pa.field("weight", pa.int64()),
    ]
)
_REQUEST_TYPES = {f.name: f.type for f in SCHEMAS["requests"]}
SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string()),
        pa.field("session_id", pa.string()),
        pa.field("tenant_id", pa.string()),
        pa.field("turn_index", pa.int64()),
        pa.field("created_at", pa.float64()),
        pa.field("model", pa.string()),
        pa.field("messages", pa.list_(MESSAGE)),
        pa.field("failed", pa.bool_()),
        *(pa.field(k, _REQUEST_TYPES[k]) for k in LAKE_FIELDS),
        pa.field("rating", pa.int64()),
        pa.field("feedback_comment", pa.string()),
        pa.field("feedback_labels", pa.list_(pa.string())),
        pa.field("feedback_at", pa.float64()),
    ]
)
"""The Parquet rows' schema: the same for every part, even an empty one."""


def _flat(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    return {**m, "content": content if content is None or isinstance(content, str) else json.dumps(content)}


def parquet_row(rec: Record) -> dict[str, Any]:
    return {**rec["metadata"], "messages": [_flat(m) for m in _weighted(rec["messages"])]}


def encode(fmt: Format, lines: Sequence[dict[str, Any]]) -> bytes:
    """One part file's bytes: ``lines`` are chat lines, preference pairs or Parquet rows."""
    if fmt is Format.PARQUET:
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(list(lines), schema=SCHEMA), buf, compression="zstd")
        return buf.getvalue()
    return b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)
