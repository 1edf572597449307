"""``tandem trace ...`` (mounted by ``tandem/cli.py``):

tandem trace import mooncake FILE --out T.parquet [--no-sessions] [--min-shared-blocks 2]
tandem trace from-lake --lake DIR --out T.parquet [--block-tokens 16] [--where SQL]
tandem trace synth agentic --out T.parquet [--sessions N --seed S --session-rate R ...]
tandem trace stats T.parquet [--block-size 16] [--json]
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from contracts.cli import clean_errors
from traces.lake import from_lake as lake_to_trace
from traces.mooncake import import_mooncake
from traces.schema import Trace, read_trace, write_trace
from traces.stats import TraceStats, trace_stats
from traces.synth import AgenticSpec, synth_agentic

trace_app = typer.Typer(help="Request traces: import, record from the lake, synthesize, inspect.", no_args_is_help=True)
import_app = typer.Typer(help="Import a trace from another format.", no_args_is_help=True)
synth_app = typer.Typer(help="Generate a synthetic trace.", no_args_is_help=True)
trace_app.add_typer(import_app, name="import")
trace_app.add_typer(synth_app, name="synth")

Out = Annotated[Path, typer.Option("--out", "-o", help="Trace file to write (Parquet).")]


def _written(trace: Trace, out: Path) -> None:
    write_trace(trace, out)
    sessions = len({s for s in trace.table.column("session_id").to_pylist() if s is not None})
    typer.echo(f"wrote {out}: {len(trace)} requests, {sessions} sessions, {trace.meta.block_tokens}-token blocks")
    if trace.meta.notes:
        typer.echo(f"notes: {trace.meta.notes}")


@import_app.command("mooncake")
def mooncake(
    file: Annotated[Path, typer.Argument(help="Mooncake trace, JSON lines (timestamp, lengths, hash_ids).")],
    out: Out,
    sessions: Annotated[bool, typer.Option(help="Infer sessions from prefix extension.")] = True,
    min_shared_blocks: Annotated[int, typer.Option(help="Blocks a turn must share with its parent.")] = 2,
) -> None:
    """Import a Mooncake FAST'25 trace (512-token hash_ids)."""
    with clean_errors():
        _written(import_mooncake(file, infer_sessions=sessions, min_shared_blocks=min_shared_blocks), out)


@trace_app.command("from-lake")
def from_lake(
    out: Out,
    lake: Annotated[Path, typer.Option("--lake", envvar="TANDEM_LAKE", help="Root folder of the lake.")] = Path("lake"),
    block_tokens: Annotated[int, typer.Option(help="Base block size of the reconstructed hashes.")] = 16,
    where: Annotated[str | None, typer.Option(help="Extra DuckDB condition on the requests table.")] = None,
) -> None:
    """A trace of the requests the lake recorded."""
    with clean_errors():
        _written(lake_to_trace(lake, block_tokens=block_tokens, where=where), out)


@synth_app.command("agentic")
def agentic(
    out: Out,
    sessions: Annotated[int, typer.Option(help="Sessions.")] = 50,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    session_rate: Annotated[float, typer.Option(help="Session arrivals per second.")] = 1.0,
    system_prompts: Annotated[int, typer.Option(help="Shared system prompts.")] = 3,
    repositories: Annotated[int, typer.Option(help="Shared repository contexts.")] = 8,
    turns_mean: Annotated[float, typer.Option(help="Mean turns per session.")] = 6.0,
    gap_s_median: Annotated[float, typer.Option(help="Median tool time between turns, s.")] = 2.0,
    max_input_tokens: Annotated[int, typer.Option(help="Longest prompt a session reaches.")] = 32768,
    block_tokens: Annotated[int, typer.Option(help="Base block size of the hashes.")] = 16,
) -> None:
    """Coding-agent sessions: shared system prompts and repositories, growing turns, tool gaps."""
    spec = AgenticSpec(
        sessions=sessions,
        seed=seed,
        session_rate=session_rate,
        system_prompts=system_prompts,
        repositories=repositories,
        turns_mean=turns_mean,
        gap_s_median=gap_s_median,
        max_input_tokens=max_input_tokens,
        block_tokens=block_tokens,
    )
    with clean_errors():
        _written(synth_agentic(spec), out)


def _fmt(d: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:,.1f}" for k, v in d.items()) if d else "-"


def render_stats(trace: Trace, s: TraceStats) -> str:
    c = s.ceiling
    lines = [
        f"source       {trace.meta.source}  ({trace.meta.block_tokens}-token base blocks)",
        f"requests     {s.requests:,}   sessions {s.sessions:,}   duration {s.duration_s:,.1f} s   "
        f"rate {s.requests / s.duration_s if s.duration_s else float('nan'):,.2f} req/s",
        f"input        {_fmt(s.input_tokens)}",
        f"output       {_fmt(s.output_tokens)}",
        f"turns/sess   {_fmt(s.turns_per_session)}",
        f"gap s        {_fmt(s.gap_s)}",
        f"cancelled    {s.cancelled:,}",
        f"hit ceiling  {c.by_tokens:.1%} of prompt tokens at block size {c.block_size} "
        f"({c.hit_tokens:,} of {c.prompt_tokens:,}); {c.by_blocks:.1%} of base blocks "
        f"({c.hit_blocks:,} of {c.base_blocks:,})",
    ]
    if s.observed_cached_tokens is not None:
        lines.append(f"observed     {s.observed_cached_tokens / c.prompt_tokens:.1%} of prompt tokens reported cached")
    if trace.meta.notes:
        lines.append(f"notes        {trace.meta.notes}")
    return "\n".join(lines)


@trace_app.command("stats")
def stats(
    trace_file: Annotated[Path, typer.Argument(help="Trace file (Parquet).")],
    block_size: Annotated[int, typer.Option(help="Block size of the hit ceiling (engine's).")] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of text.")] = False,
) -> None:
    """Sessions, requests, lengths, gaps and the cache-hit ceiling of a trace."""
    with clean_errors():
        trace = read_trace(trace_file)
        s = trace_stats(trace, block_size)
    if as_json:
        d = asdict(s)
        d["ceiling"].update(by_tokens=s.ceiling.by_tokens, by_blocks=s.ceiling.by_blocks)
        print(json.dumps(d))
    else:
        typer.echo(render_stats(trace, s))
