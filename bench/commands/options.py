"""Option types that several ``tandem bench`` commands share, so their help reads the same everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Out = Annotated[Path, typer.Option(help="JSON results; a PNG plot is written beside it.")]
RedisUrl = Annotated[
    str | None,
    typer.Option(
        help="Registry Redis for the benchmark's clusters (default: $TANDEM_REDIS_URL, a database of its own)."
    ),
]
