"""One export run: read what is past the watermark, filter, redact, shape, write in parts, advance.

    turns past the watermark (and settled) ─► examples with their context ─► + lake rows and feedback
        ─► consent and filters (counted by reason) ─► redaction hook ─► chat lines / Parquet rows /
        preference pairs, in position order ─► parts of ``batch_rows``: write durably, then commit the
        manifest row and the watermark together (``watermark``)

Rows newer than ``settle_s`` wait for the next run, so a turn or a feedback row still on its way (the
session writer's queue, the lake writer's batches) cannot land behind a watermark that has passed it. A
dry run reads and counts the same way and writes nothing, not even its tables. A run that wrote parts
ends by rewriting ``_<name>.manifest.json`` beside them: the committed parts (derived from the database,
which stays the authority).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.errors import ConfigError
from telemetry.export import formats, redact
from telemetry.export import watermark as wmk
from telemetry.export.consent import allowed_tenants
from telemetry.export.db import ExportDb, open_db
from telemetry.export.filters import Filters, apply
from telemetry.export.formats import Format, PairRule
from telemetry.export.settings import ExportSettings
from telemetry.export.sink import Sink
from telemetry.export.source import build_examples, join_lake, nth_turn_end, rated_request_ids, sessions_of_turns
from telemetry.export.source import sessions_with_turns_between as turns_between

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
Line = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class ExportSpec:
    name: str
    fmt: Format
    out: str | None
    """Destination folder or URI; may be None only for a dry run."""
    lake: Path | None
    filters: Filters = Filters()
    pair_rule: PairRule = PairRule.ALL
    dry_run: bool = False


@dataclass(slots=True)
class ExportResult:
    name: str
    fmt: Format
    dry_run: bool
    until: float = 0.0
    candidates: int = 0
    """Turns (preference: rated turns) past the watermark, before consent and filters."""
    rows: int = 0
    """Lines or rows written (or, in a dry run, that would be)."""
    parts: list[str] = field(default_factory=list)
    filtered: Counter[str] = field(default_factory=Counter)
    per_tenant: Counter[str] = field(default_factory=Counter)
    """Examples kept per tenant (preference: the rated turns that went into pairs' pool)."""
    rated: int = 0
    """Kept examples that carry feedback."""
    watermark: wmk.Watermark | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "until": self.until,
            "candidates": self.candidates,
            "rows": self.rows,
            "parts": len(self.parts),
            "filtered": dict(self.filtered),
            "per_tenant": dict(self.per_tenant),
            "examples": sum(self.per_tenant.values()),
            "rated": self.rated,
        }


def run_export(spec: ExportSpec, settings: ExportSettings, *, now: float | None = None) -> ExportResult:
    if not _NAME.match(spec.name):
        raise ConfigError(f"export name {spec.name!r}: 1-64 characters of [A-Za-z0-9._-]")
    if spec.out is None and not spec.dry_run:
        raise ConfigError("an export needs --out (or --dry-run)")
    hook = redact.load_hook(settings.redact)
    db = open_db(settings.store_url(), create=False)
    try:
        return _run(db, spec, settings, hook, time.time() if now is None else now)
    finally:
        db.close()


def _run(
    db: ExportDb, spec: ExportSpec, settings: ExportSettings, hook: redact.Hook | None, now: float
) -> ExportResult:
    started = time.time()
    if not spec.dry_run:
        wmk.init_schema(db)
    has_marks = db.has_table("tandem_export_watermarks")
    wm = wmk.load(db, spec.name, spec.fmt) if has_marks else wmk.Watermark(spec.name, spec.fmt, None)
    until = min(math.inf if spec.filters.until is None else spec.filters.until, now - settings.settle_s)
    result = ExportResult(spec.name, spec.fmt, spec.dry_run, until=until, watermark=wm)
    reading = _Reading(db, spec, wm, until, allowed_tenants(db), hook)
    if spec.fmt is Format.PREFERENCE_JSONL:
        lines = _pair_lines(reading, result)
    else:
        lines = _turn_lines(reading, settings, result)
    lines.sort(key=lambda line: line[0])
    result.rows = len(lines)
    if spec.dry_run or spec.out is None:
        return result
    sink = Sink(spec.out, settings.storage_options(spec.out))
    written = 0
    for i in range(0, len(lines), settings.batch_rows):
        batch = lines[i : i + settings.batch_rows]
        filename = f"{spec.name}-{wm.parts:06d}.{spec.fmt.extension}"
        uri = sink.write(filename, formats.encode(spec.fmt, [line for _, line in batch]))
        written += 1
        if written == settings.fault_kill_after_parts:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection: durable part, watermark not committed
        wm = wmk.commit(db, wm, uri, len(batch), batch[0][0], batch[-1][0])
        result.parts.append(uri)
    result.watermark = wm
    if result.parts:
        sink.write(f"_{spec.name}.manifest.json", _manifest(db, spec.name))
    wmk.record_run(db, spec.name, started, spec.fmt, False, result.rows, result.summary())
    return result


def _manifest(db: ExportDb, name: str) -> bytes:
    """The committed parts of ``name``, for readers of the destination: a part not listed is one a killed
    run left uncommitted, which the next run replaces."""
    listed = [
        {"seq": p.seq, "uri": p.uri, "rows": p.rows, "first": list(p.first), "last": list(p.last)}
        for p in wmk.parts(db, name)
    ]
    return json.dumps({"name": name, "parts": listed}, indent=1).encode()


@dataclass(frozen=True)
class _Reading:
    """What a run reads with: its database and spec, its watermark, the time it reads up to (settled
    rows only), the tenants that consented, the redaction hook."""

    db: ExportDb
    spec: ExportSpec
    wm: wmk.Watermark
    until: float
    consented: frozenset[str]
    hook: redact.Hook | None


def _turn_lines(r: _Reading, settings: ExportSettings, result: ExportResult) -> list[Line]:
    spec, wm, until = r.spec, r.wm, r.until
    after = float(wm.position[0]) if wm.position else 0.0
    if settings.run_max_turns:
        until = min(until, nth_turn_end(r.db, after, until, settings.run_max_turns) or until)
    examples = [e for e in build_examples(turns_between(r.db, after, until)) if wm.passes(e.position)]
    examples = join_lake(examples, spec.lake)
    result.candidates = len(examples)
    kept, result.filtered = apply(examples, spec.filters, r.consented)
    out: list[Line] = []
    for ex in kept:
        rec = redact.apply(r.hook, formats.record(ex))
        if rec is None:
            result.filtered["redacted_out"] += 1
            continue
        line = formats.parquet_row(rec) if spec.fmt is Format.PARQUET else formats.chat_line(rec)
        out.append((ex.position, line))
        result.per_tenant[ex.tenant_id] += 1
        result.rated += ex.feedback is not None
    return out


def _pair_lines(r: _Reading, result: ExportResult) -> list[Line]:
    spec, until = r.spec, r.until
    examples = join_lake(build_examples(sessions_of_turns(r.db, rated_request_ids(spec.lake, until))), spec.lake)
    examples = [e for e in examples if e.feedback is not None and e.feedback.at <= until and e.created_at <= until]
    result.candidates = len(examples)
    kept, result.filtered = apply(examples, spec.filters, r.consented)
    rated = []
    for ex in kept:
        rec = redact.apply(r.hook, formats.record(ex))
        if rec is None:
            result.filtered["redacted_out"] += 1
            continue
        rated.append((ex, rec))
        result.per_tenant[ex.tenant_id] += 1
        result.rated += 1
    return [(pos, line) for pos, line in formats.pairs(rated, spec.pair_rule) if r.wm.passes(pos)]
