"""Command-line entry points, mounted by ``tandem/cli.py`` as ``tandem telemetry ...`` and
``tandem lake ...``:

    tandem telemetry consume   --redis-url --lake --group --consumer --batch-entries --block-ms
                               --cpu-priority idle|normal ...
    tandem telemetry compact   --redis-url --lake --min-age-s
    tandem telemetry schema    [TABLE]
    tandem lake query "SQL"    --lake --format table|csv|json
    tandem lake report         --lake --out DIR
    tandem lake questions      [NAME] [--sql | --run] --lake --format
    tandem lake export         --format --out --name --dry-run [filters]   (telemetry.export)
    tandem lake consent        [TENANT --allow|--deny]
"""

from __future__ import annotations

import csv
import json
import logging
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Annotated

import pyarrow as pa
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from contracts.config import DEFAULT_LAKE_DIR, LAKE_DIR_ENV, lake_dir, redacted
from contracts.config import redis_url as configured_redis_url
from contracts.errors import ConfigError, StoreError
from telemetry.emitter import DEFAULT_STREAM_PREFIX
from telemetry.lake_writer import LakeWriter, WriterConfig
from telemetry.priority import CpuPriority, apply_cpu_priority
from telemetry.schemas import TABLE_NAMES, describe

telemetry_app = typer.Typer(help="Slow-path telemetry: the lake writer and its maintenance.", no_args_is_help=True)
lake_app = typer.Typer(help="Query the Parquet data lake and render reports.", no_args_is_help=True)

_console = Console(stderr=True)

RedisUrl = Annotated[
    str | None, typer.Option("--redis-url", help="Redis holding the telemetry streams (default: $TANDEM_REDIS_URL).")
]
LakeDir = Annotated[
    Path | None,
    typer.Option(
        "--lake",
        help=f"Root folder of the Parquet lake (default: ${LAKE_DIR_ENV}, else {DEFAULT_LAKE_DIR}, where `tandem up` "
        "writes it).",
    ),
]
Prefix = Annotated[str, typer.Option("--stream-prefix", help="Stream name prefix; streams are <prefix>:<table>.")]
Group = Annotated[str, typer.Option("--group", help="Redis consumer group shared by all writers of this lake.")]


def _parse_tables(tables: str) -> tuple[str, ...]:
    out = tuple(t.strip() for t in tables.split(",") if t.strip())
    bad = [t for t in out if t not in TABLE_NAMES]
    if bad:
        raise typer.BadParameter(f"unknown tables {bad}; known: {', '.join(TABLE_NAMES)}")
    return out


def existing_lake(flag: Path | None) -> Path:
    """The resolved lake (``contracts.config.lake_dir``) for a command that reads it. A lake that is not
    there is said so on stderr, naming the folder and the rule that chose it, and the command exits 2:
    an empty table for a mistyped path would read as "no traffic"."""
    where = lake_dir(flag)
    if not where.path.is_dir():
        _console.print(
            f"[red]no lake at {where.path}[/red] (from {where.source}). Pass --lake DIR, set ${LAKE_DIR_ENV}, or "
            f"run `tandem up`, whose lake writer fills {DEFAULT_LAKE_DIR}.",
            soft_wrap=True,
        )
        raise typer.Exit(2)
    return where.path


@telemetry_app.command()
def consume(
    redis_url: RedisUrl = None,
    lake: LakeDir = None,
    group: Group = "lake",
    consumer: Annotated[
        str,
        typer.Option(
            "--consumer",
            help="This writer's name in the group. Keep it stable across restarts (default: host name) so a "
            "restarted writer resumes its own pending entries at once.",
        ),
    ] = socket.gethostname(),
    stream_prefix: Prefix = DEFAULT_STREAM_PREFIX,
    tables: Annotated[str, typer.Option("--tables", help="Comma-separated tables to consume.")] = ",".join(TABLE_NAMES),
    batch_entries: Annotated[
        int, typer.Option("--batch-entries", min=1, help="Stream entries (emitter batches) per Parquet part.")
    ] = 64,
    block_ms: Annotated[int, typer.Option("--block-ms", min=1, help="How long one read waits for entries.")] = 1000,
    claim_idle_s: Annotated[
        float, typer.Option("--claim-idle-s", help="Take over other consumers' entries pending this long.")
    ] = 60.0,
    recover_every_s: Annotated[
        float, typer.Option("--recover-every-s", help="How often to look for pending entries to take over.")
    ] = 30.0,
    compression: Annotated[str, typer.Option("--compression", help="Parquet codec.")] = "zstd",
    once: Annotated[bool, typer.Option("--once", help="Write what is waiting now, then exit.")] = False,
    metrics_port: Annotated[
        int,
        typer.Option(
            "--metrics-port",
            help="Serve Prometheus /metrics on 127.0.0.1:PORT (written, dead-lettered entries; disk full); 0: off.",
        ),
    ] = 0,
    cpu_priority: Annotated[
        CpuPriority,
        typer.Option(
            "--cpu-priority",
            help="idle: SCHED_IDLE and nice 19, so the writer only uses CPU time that engines and routers "
            "leave idle (telemetry.priority); normal: as started.",
        ),
    ] = CpuPriority.IDLE,
) -> None:
    """Consume the telemetry streams into Parquet files under LAKE (at least once, de-duplicated)."""
    redis_url = redis_url or configured_redis_url()
    lake = lake_dir(lake).path
    lake.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    priority = apply_cpu_priority(cpu_priority)
    cfg = WriterConfig(
        lake=lake,
        redis_url=redis_url,
        stream_prefix=stream_prefix,
        group=group,
        consumer=consumer,
        tables=_parse_tables(tables),
        batch_entries=batch_entries,
        block_ms=block_ms,
        claim_idle_s=claim_idle_s,
        compression=compression,
    )
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr="127.0.0.1")
    _run_writer(cfg, once=once, recover_every_s=recover_every_s, priority=priority)


def _run_writer(cfg: WriterConfig, *, once: bool, recover_every_s: float, priority: str) -> None:
    """Drain once, or consume until SIGINT/SIGTERM; a store error exits 1 with its message."""
    writer = LakeWriter(cfg)
    try:
        if once:
            s = writer.drain()
            _console.print(f"wrote {s.rows} events in {s.files} files ({s.entries} entries)")
            return
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        _console.print(
            f"consuming {', '.join(cfg.tables)} from {redacted(cfg.redis_url)} into {cfg.lake} as "
            f"{cfg.group}/{cfg.consumer} (CPU priority: {priority})"
        )
        total = writer.run(stop, recover_every_s=recover_every_s)
        _console.print(f"stopped: wrote {total.rows} events in {total.files} files")
    except StoreError as exc:
        _console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    finally:
        writer.close()


@telemetry_app.command()
def compact(
    redis_url: RedisUrl = None,
    lake: LakeDir = None,
    group: Group = "lake",
    stream_prefix: Prefix = DEFAULT_STREAM_PREFIX,
    min_age_s: Annotated[float, typer.Option("--min-age-s", help="Only merge part files at least this old.")] = 600.0,
) -> None:
    """Merge each partition's small part files into one (atomic, de-duplicated on event_id)."""
    redis_url = redis_url or configured_redis_url()
    lake = existing_lake(lake)
    writer = LakeWriter(WriterConfig(lake=lake, redis_url=redis_url, stream_prefix=stream_prefix, group=group))
    try:
        n = sum(1 for t in TABLE_NAMES if (lake / t).is_dir() for _ in (lake / t).glob("date=*/hour=*"))
        with Progress(console=_console, transient=True) as progress:
            task = progress.add_task("compacting", total=n)
            results = writer.compact(min_age_s=min_age_s, progress=lambda _p: progress.advance(task))
    except StoreError as exc:
        _console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    finally:
        writer.close()
    merged = sum(len(r.inputs) for r in results)
    _console.print(f"compacted {len(results)} partitions ({merged} files merged)")


@telemetry_app.command()
def schema(table: Annotated[str | None, typer.Argument(help="Table; all when omitted.")] = None) -> None:
    """Print the telemetry tables' fields with their documentation."""
    for t in [table] if table else TABLE_NAMES:
        if t not in TABLE_NAMES:
            raise typer.BadParameter(f"unknown table {t!r}")
        typer.echo(describe(t))


@lake_app.command("query")
def query_cmd(
    sql: Annotated[str, typer.Argument(help="SQL over the views " + ", ".join(TABLE_NAMES) + ".")],
    lake: LakeDir = None,
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json (one object per line).")] = "table",
    limit: Annotated[int, typer.Option("--limit", help="Most rows printed in table format.")] = 200,
) -> None:
    """Run SQL (DuckDB) over the lake. Partition columns: date, hour."""
    import duckdb

    from telemetry.query import query

    path = existing_lake(lake)
    try:
        result = query(path, sql)
    except duckdb.Error as exc:
        _console.print(f"[red]query failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    _print_result(result, fmt, limit)


def _print_result(result: pa.Table, fmt: str, limit: int) -> None:
    rows = result.to_pylist()
    if fmt == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(result.column_names)
        for r in rows:
            w.writerow(r.values())
    elif fmt == "json":
        for r in rows:
            typer.echo(json.dumps(r, default=str))
    else:
        t = Table(*result.column_names)
        for r in rows[:limit]:
            t.add_row(*("" if v is None else str(v) for v in r.values()))
        Console().print(t)
        if len(rows) > limit:
            _console.print(f"({len(rows)} rows, {limit} shown)")


@lake_app.command()
def report(
    out: Annotated[Path, typer.Option("--out", help="Folder for index.html and the PNG plots.")],
    lake: LakeDir = None,
    exports: Annotated[
        bool,
        typer.Option(
            "--exports/--no-exports",
            help="Add the exports' view (rows per export and tenant, feedback coverage, what was filtered), "
            "read from the session store (TANDEM_DATABASE_URL / TANDEM_SQLITE_PATH).",
        ),
    ] = True,
) -> None:
    """Render an HTML report: hit-rate breakdown, TTFT/ITL, P/D decisions, KV transfers, exports."""
    from telemetry.report import SECTIONS, render_report

    lake = existing_lake(lake)
    view = None
    if exports:
        from telemetry.export import ExportSettings
        from telemetry.export.view import export_view

        view = export_view(ExportSettings())
    with Progress(console=_console, transient=True) as progress:
        task = progress.add_task("rendering", total=len(SECTIONS))
        rep = render_report(lake, out, on_step=lambda name: progress.advance(task), exports=view)
    if rep.empty:
        _console.print(f"the lake at {lake} holds no request records; wrote an empty report to {rep.index}")
    else:
        _console.print(f"report on {rep.requests} requests: {rep.index} ({len(rep.images)} plots)")


@lake_app.command()
def questions(
    name: Annotated[str | None, typer.Argument(help="One question by name; all when omitted.")] = None,
    sql_only: Annotated[bool, typer.Option("--sql", help="Print only the SQL (for `tandem lake query`).")] = False,
    run: Annotated[bool, typer.Option("--run", help="Run the question(s) against the lake and print rows.")] = False,
    lake: LakeDir = None,
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json, with --run.")] = "table",
) -> None:
    """Ready-made SQL for researchers (why did session X miss on turn N, hit rate by tool pause,
    transfer s/GB by transport, P/D vs colocated TTFT by prompt length, misses by kind)."""
    import duckdb

    from telemetry.query import query
    from telemetry.questions import BY_NAME, QUESTIONS, catalogue

    if name is not None and name not in BY_NAME:
        raise typer.BadParameter(f"unknown question {name!r}; known: {', '.join(BY_NAME)}")
    chosen = [BY_NAME[name]] if name else list(QUESTIONS)
    if not run:
        if sql_only:
            typer.echo("\n".join(q.sql + ";" for q in chosen))
        else:
            typer.echo(catalogue() if name is None else f"-- {chosen[0].name}: {chosen[0].question}\n{chosen[0].sql};")
        return
    path = existing_lake(lake)
    for q in chosen:
        _console.print(f"[bold]{q.name}[/bold]: {q.question}", soft_wrap=True)
        try:
            _print_result(query(path, q.sql), fmt, 200)
        except duckdb.Error as exc:
            _console.print(f"[red]query failed:[/red] {exc}")
            raise typer.Exit(1) from exc


def _instant(value: str | None) -> float | None:
    """``--since`` / ``--until``: ISO 8601 (``YYYY-MM-DDTHH:MM:SSZ``; no zone means UTC) or Unix seconds."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    from datetime import UTC, datetime

    try:
        t = datetime.fromisoformat(value)
    except ValueError as exc:
        raise typer.BadParameter(f"{value!r} is neither ISO 8601 nor Unix seconds") from exc
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


@lake_app.command("export")
def export_cmd(
    fmt: Annotated[
        str, typer.Option("--format", help="chat-jsonl (OpenAI fine-tuning), preference-jsonl (DPO pairs), parquet.")
    ] = "chat-jsonl",
    out: Annotated[
        str | None, typer.Option("--out", help="Folder or fsspec URI (s3://bucket/prefix) the parts go to.")
    ] = None,
    name: Annotated[str, typer.Option("--name", help="Export name: its watermark and part names.")] = "default",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would be exported; write nothing.")] = False,
    lake: LakeDir = None,
    tenant: Annotated[list[str] | None, typer.Option("--tenant", help="Only this tenant (repeatable).")] = None,
    model: Annotated[list[str] | None, typer.Option("--model", help="Only this served model (repeatable).")] = None,
    since: Annotated[str | None, typer.Option("--since", help="Turns ended at or after (ISO 8601 or Unix s).")] = None,
    until: Annotated[str | None, typer.Option("--until", help="Turns ended at or before (ISO 8601 or Unix s).")] = None,
    feedback: Annotated[str, typer.Option("--feedback", help="any, rated (with feedback) or unrated.")] = "any",
    min_rating: Annotated[int | None, typer.Option("--min-rating", help="Only ratings >= this.")] = None,
    max_rating: Annotated[int | None, typer.Option("--max-rating", help="Only ratings <= this.")] = None,
    include_failed: Annotated[
        bool, typer.Option("--include-failed", help="Keep turns the lake says failed or were cancelled (marked).")
    ] = False,
    pairs: Annotated[
        str, typer.Option("--pairs", help="preference-jsonl: all (every two ratings that differ) or extremes.")
    ] = "all",
    as_json: Annotated[bool, typer.Option("--json", help="Print the run's summary as JSON on stdout.")] = False,
) -> None:
    """Export served sessions (turns, tool calls and results), joined with the lake's request rows and
    feedback, from consenting tenants, past this export name's watermark, exactly once."""
    from telemetry.export import ExportSettings, ExportSpec, FeedbackFilter, Filters, Format, PairRule, run_export

    try:
        spec = ExportSpec(
            name=name,
            fmt=Format(fmt),
            out=out,
            lake=lake_dir(lake).path,
            filters=Filters(
                tenants=frozenset(tenant or ()),
                models=frozenset(model or ()),
                since=_instant(since),
                until=_instant(until),
                feedback=FeedbackFilter(feedback),
                min_rating=min_rating,
                max_rating=max_rating,
                include_failed=include_failed,
            ),
            pair_rule=PairRule(pairs),
            dry_run=dry_run,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        result = run_export(spec, ExportSettings())
    except (StoreError, ConfigError) as exc:
        _console.print(f"[red]export failed:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(1) from exc
    summary = result.summary()
    verb = "would export" if dry_run else "exported"
    where = "" if dry_run else f" in {len(result.parts)} parts to {out}"
    filtered = ", ".join(f"{k} {v}" for k, v in sorted(result.filtered.items())) or "none"
    line = f"{name}: {verb} {result.rows} {fmt} rows{where}; {result.candidates} candidates, filtered: {filtered}"
    if as_json:
        _console.print(line, soft_wrap=True, markup=False)
        typer.echo(json.dumps({"name": name, "format": fmt, "dry_run": dry_run, "uris": result.parts, **summary}))
    else:
        typer.echo(line)


@lake_app.command("consent")
def consent_cmd(
    tenant: Annotated[str | None, typer.Argument(help="Tenant; all recorded consents when omitted.")] = None,
    allow: Annotated[
        bool | None, typer.Option("--allow/--deny", help="Record that the tenant opted in (or out) of exports.")
    ] = None,
    note: Annotated[str | None, typer.Option("--note", help="Why, for the record.")] = None,
) -> None:
    """Record or list which tenants' conversations may be exported (default: none)."""
    from telemetry.export import ExportSettings, consents, set_consent
    from telemetry.export.db import open_db

    if tenant is not None and allow is None:
        raise typer.BadParameter("give --allow or --deny with a tenant")
    try:
        db = open_db(ExportSettings().store_url())
        try:
            if tenant is not None and allow is not None:
                set_consent(db, tenant, allow, note)
            rows = consents(db)
        finally:
            db.close()
    except (StoreError, ConfigError) as exc:
        _console.print(f"[red]consent failed:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(1) from exc
    for c in rows if tenant is None else [c for c in rows if c.tenant_id == tenant]:
        typer.echo(f"{c.tenant_id}\t{'allowed' if c.allowed else 'denied'}\t{c.note or ''}")
