"""``tandem tier``: run the host's KV block tier, and read its state."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ByteSize, TypeAdapter
from rich.console import Console

from contracts.cli import clean_errors, interrupt, setup_logging
from contracts.cluster import CLUSTER_ENV, validate
from contracts.config import shared_settings

tier_app = typer.Typer(
    help="The host tier: a shared-memory KV block store every engine on this host shares.", no_args_is_help=True
)
console = Console()


@tier_app.command()
def serve(
    model: Annotated[Path, typer.Option(help="Model folder the engines serve (its config.json gives the layout).")],
    dtype: Annotated[str, typer.Option(help="KV dtype of the engines: bfloat16, float32, float16.")] = "bfloat16",
    block_size: Annotated[
        int, typer.Option(help="Engines' --block-size (vLLM's CPU attention needs a multiple of 32).")
    ] = 32,
    size: Annotated[str | None, typer.Option(help="Bytes of blocks to hold, e.g. 2GiB (env TANDEM_TIER_SIZE).")] = None,
    log_level: str = "info",
) -> None:
    """Serve the tier until Ctrl-C. Blocks live in /dev/shm and outlive this process: a restarted tier
    finds them again (each verified by its checksum)."""
    from host_tier.server import serve as run
    from host_tier.settings import TierSettings, layout_from_model

    setup_logging(log_level)
    signal.signal(signal.SIGTERM, interrupt)
    with clean_errors():
        settings = TierSettings(size=TypeAdapter(ByteSize).validate_python(size)) if size else TierSettings()
        layout = layout_from_model(model, dtype, block_size, shared_settings().hash_seed)
        path = settings.path_for(layout)
        console.print(f"host tier: {settings.n_slots(layout)} blocks of {layout.block_bytes} B at {path}")
        lake = None
        if settings.telemetry_redis_url:
            from host_tier.lake import TierIdentity, open_lake

            lake = open_lake(settings, TierIdentity.of(path, layout.model, layout.fingerprint()))
        try:
            run(
                path,
                layout.block_bytes,
                settings.n_slots(layout),
                layout.fingerprint(),
                settings.endpoint,
                settings.events_endpoint,
                block_size,
                settings.write_timeout_s,
                replay_endpoint=settings.replay_endpoint,
                tenant_pin_share=settings.tenant_pin_share,
                metrics_port=settings.metrics_port,
                lake=lake,
            )
        except KeyboardInterrupt:
            pass


def _mapped_by(path: Path) -> list[int]:
    """Pids of the processes that have ``path`` mapped (a tier server, an engine's connector)."""
    pids = []
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if str(path) in maps.read_text():
                pids.append(int(maps.parent.name))
        except OSError:  # the process ended, or is not ours to read
            continue
    return pids


@tier_app.command()
def stats(
    endpoint: Annotated[str | None, typer.Option(help="The tier's control socket (env TANDEM_TIER_ENDPOINT).")] = None,
) -> None:
    """Print what the running tier holds: blocks by state, hits, evictions by reason, pins."""
    from host_tier import messages as m
    from host_tier.client import ask
    from host_tier.settings import TierSettings

    with clean_errors():
        reply = ask(endpoint or TierSettings().endpoint, m.Stats(), timeout_s=5.0)
        assert isinstance(reply, m.TierStats)
        for field in reply.__struct_fields__:
            console.print(f"{field:>14}  {getattr(reply, field)}")


@tier_app.command()
def clear(
    dir: Annotated[Path | None, typer.Option(help="Where the tier files are (env TANDEM_TIER_DIR).")] = None,
    cluster: Annotated[
        str | None,
        typer.Option(envvar=CLUSTER_ENV, help="Remove this cluster's tier files only (default: `default`)."),
    ] = None,
    all_clusters: Annotated[bool, typer.Option(help="Remove every cluster's tier files (`tandem-tier-*`).")] = False,
    force: Annotated[bool, typer.Option(help="Remove a file even while a process has it mapped.")] = False,
) -> None:
    """Remove a cluster's tier files and give their RAM back. A tier's blocks outlive every process by
    design, so nothing else removes them; a file some process still maps (a running tier or engine) is
    kept unless --force (the processes keep their mapping; new ones start empty). Other clusters' files
    on the host are left alone unless --all-clusters."""
    from host_tier.settings import TierSettings

    with clean_errors():
        try:
            update = {"dir": dir or TierSettings().dir, "cluster": validate(cluster or TierSettings().cluster)}
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--cluster") from exc
        settings = TierSettings().model_copy(update=update)
        paths = sorted(settings.dir.glob("tandem-tier-*")) if all_clusters else settings.own_files()
        kept = 0
        for path in paths:
            users = _mapped_by(path.resolve())
            if users and not force:
                console.print(f"kept {path}: mapped by pid {', '.join(map(str, users))} (stop them, or --force)")
                kept += 1
                continue
            size = path.stat().st_size
            path.unlink()
            console.print(f"removed {path} ({size / 2**20:.0f} MiB)")
        if kept:
            raise typer.Exit(1)
