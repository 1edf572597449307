"""``tandem bench ...``: the benchmarks, each starting and stopping what it measures, each ending with a
``RESULT`` line.

This module builds the Typer app and registers the commands, in the order ``tandem bench --help`` lists
them; the commands themselves live in ``bench.commands`` by group (``compare``: Tandem beside what it
wraps or replaces; ``kv``: KV transfer and reuse; ``service``: telemetry, admission, chaos, hosts, the simulator)."""

from __future__ import annotations

import signal

import typer

from bench.commands.compare import bench_agents, bench_fleet, bench_overhead, bench_pd, bench_routing
from bench.commands.kv import bench_kv_cache, bench_kv_transfer
from bench.commands.service import bench_admission, bench_chaos, bench_hosts, bench_sim, bench_telemetry
from contracts.cli import interrupt

bench_app = typer.Typer(
    help="Benchmarks (write JSON results, render plots, print a RESULT line).", no_args_is_help=True
)


@bench_app.callback()
def _bench_signals() -> None:
    """SIGTERM unwinds every benchmark like Ctrl-C, so the clusters and processes it started are stopped
    by the code that started them (a shell's background job ignores SIGINT, so a script can only stop
    it with SIGTERM). Their parent-death signal covers a benchmark killed outright."""
    signal.signal(signal.SIGTERM, interrupt)


for _name, _command in (
    ("pd", bench_pd),
    ("overhead", bench_overhead),
    ("kv-transfer", bench_kv_transfer),
    ("routing", bench_routing),
    ("fleet", bench_fleet),
    ("agents", bench_agents),
    ("kv-cache", bench_kv_cache),
    ("telemetry", bench_telemetry),
    ("admission", bench_admission),
    ("chaos", bench_chaos),
    ("hosts", bench_hosts),
    ("sim", bench_sim),
):
    bench_app.command(_name)(_command)
