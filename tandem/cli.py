"""``tandem``: every package's sub-commands under one command. Nothing is defined here but the mounts;
the top of the import graph (``pyproject.toml``'s import contracts)."""

from __future__ import annotations

import typer

from bench.cli import bench_app
from host_tier.cli import tier_app
from infra.cli import cluster_app, model_app, up
from infra.lab.cli import lab_app
from node_agent.cli import node
from planner.cli import plan_cmd
from profiling.cli import profile_cmd
from replay.cli import replay
from router.admission.cli import keys_app
from router.cli import router
from tandem.settings_doc import settings_cmd
from telemetry.cli import lake_app, telemetry_app
from traces.cli import trace_app

app = typer.Typer(help="Tandem: prefill/decode disaggregated LLM serving on vLLM.", no_args_is_help=True)
app.command()(node)
app.command()(router)
app.command()(up)
app.command()(replay)
app.command("plan")(plan_cmd)
app.command("profile")(profile_cmd)
app.command("settings")(settings_cmd)
app.add_typer(model_app, name="model")
app.add_typer(cluster_app, name="cluster")
app.add_typer(bench_app, name="bench")
app.add_typer(keys_app, name="keys")
app.add_typer(telemetry_app, name="telemetry")
app.add_typer(lake_app, name="lake")
app.add_typer(trace_app, name="trace")
app.add_typer(tier_app, name="tier")
app.add_typer(lab_app, name="lab")

__all__ = ["app"]
