"""``tandem plan --trace T --slo ttft_p90=1.5s,itl_p90=50ms [--profile P] [--rate R] ...`` (mounted by
``tandem/cli.py``): the cheapest SIMULATED fleet meeting the targets (``planner.search``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import pyarrow.compute as pc
import typer

from contracts.cli import clean_errors
from planner.search import SLO, Tried, plan, plot
from simulator.fleet import SIMULATED
from simulator.keys import prepare
from simulator.step_model import Profile, placeholder_profile
from traces.schema import Trace, read_trace


def _row(t: Tried) -> str:
    p = t.percentiles
    return (
        f"{t.layout.describe():<52} cost {t.cost:>6.0f}  "
        f"TTFT p50 {p['ttft_p50'] * 1e3:7.0f} p90 {p['ttft_p90'] * 1e3:7.0f} ms  "
        f"ITL p50 {p['itl_p50'] * 1e3:5.1f} p90 {p['itl_p90'] * 1e3:5.1f} ms  attain {t.attainment:6.1%}"
        f"  hit {t.hit_rate:5.1%}  {'MEETS' if t.meets else 'misses'}  ({t.wall_s:.1f} s)"
    )


def plan_cmd(
    trace_file: Annotated[Path, typer.Option("--trace", help="Trace file (Parquet), e.g. from `tandem trace import`.")],
    slo: Annotated[str, typer.Option(help="Targets, e.g. ttft_p90=1.5s,itl_p90=50ms (s or ms).")],
    profile: Annotated[
        Path | None, typer.Option(help="Step-model profile (JSON from `tandem profile`); default PLACEHOLDER.")
    ] = None,
    rate: Annotated[
        float | None, typer.Option(help="Compress or stretch the trace's arrivals to this many requests/s.")
    ] = None,
    block_size: Annotated[
        int, typer.Option(help="KV block size of the simulated nodes (0: the trace's own base block size).")
    ] = 0,
    kv_tokens: Annotated[int, typer.Option(help="KV capacity per node, tokens.")] = 4_000_000,
    max_nodes: Annotated[int, typer.Option(help="Largest fleet to try.")] = 2000,
    out: Annotated[Path, typer.Option(help="JSON of every simulation tried; a PNG beside it.")] = Path(
        "results/plan.json"
    ),
) -> None:
    """SIMULATED: the cheapest fleet (aggregated or P:D, node count, conditional-disaggregation threshold)
    that meets the latency targets on the trace, with predicted percentiles, goodput and a plot of cost
    against target attainment."""
    with clean_errors():
        trace = read_trace(trace_file)
    try:
        targets = SLO.parse(slo)
        prof = Profile.load(profile) if profile else placeholder_profile()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if rate:
        t = trace.table
        arr = t.column("arrival_s")
        span = pc.max(arr).as_py() - pc.min(arr).as_py()
        factor = (len(trace) / rate) / span if span > 0 else 1.0
        t = t.set_column(t.schema.get_field_index("arrival_s"), "arrival_s", pc.multiply(arr, factor))
        trace = Trace(t, trace.meta)
    bs = block_size or trace.meta.block_tokens
    prep = prepare(trace, bs)
    typer.echo(
        f"{SIMULATED} plan: {len(trace)} requests over {prep.arrival_s[-1] - prep.arrival_s[0]:.2f} s"
        f" ({len(trace) / max(prep.arrival_s[-1] - prep.arrival_s[0], 1e-9):,.0f} req/s), block size {bs},"
        f" {kv_tokens:,} KV tokens a node; profile: {prof.description}"
    )
    typer.echo(f"targets: {targets.describe()}")
    result = plan(
        prep, prof, targets, kv_tokens_per_node=kv_tokens, max_nodes=max_nodes, on_try=lambda t: typer.echo(_row(t))
    )
    typer.echo(f"{len(result.tried)} simulations in {result.wall_s:.0f} s")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "label": SIMULATED,
        "trace": str(trace_file),
        "rate": rate,
        "block_size": bs,
        "profile": prof.description,
        "slo": targets.describe(),
        "wall_s": result.wall_s,
        "tried": [asdict(t) for t in result.tried],
        "best": asdict(result.best) if result.best else None,
    }
    out.write_text(json.dumps(doc, indent=1, default=str))
    plot(result, str(out.with_suffix(".png")))
    if result.best is None:
        typer.echo(f"{SIMULATED}: no configuration up to {max_nodes} nodes meets {targets.describe()}")
        raise typer.Exit(2)
    b = result.best
    p = b.percentiles
    typer.echo(
        f"{SIMULATED} cheapest meeting the targets: {b.layout.describe()}, cost {b.cost:.0f}; "
        f"TTFT p50 {p['ttft_p50']:.3f} s p90 {p['ttft_p90']:.3f} s p99 {p['ttft_p99']:.3f} s; "
        f"ITL p50 {p['itl_p50'] * 1e3:.1f} ms p90 {p['itl_p90'] * 1e3:.1f} ms; "
        f"goodput {b.goodput_rps:,.0f} req/s ({b.attainment:.1%} of requests meet every target); hit {b.hit_rate:.1%}"
    )
    typer.echo(f"wrote {out} and {out.with_suffix('.png')}")
