"""``tandem tier``: run the host's KV block tier, and read its state."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ByteSize, TypeAdapter
from rich.console import Console

from contracts.cli import clean_errors, interrupt, setup_logging

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
        layout = layout_from_model(model, dtype, block_size, os.environ.get("PYTHONHASHSEED"))
        path = settings.path_for(layout)
        console.print(f"host tier: {settings.n_slots(layout)} blocks of {layout.block_bytes} B at {path}")
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
            )
        except KeyboardInterrupt:
            pass
