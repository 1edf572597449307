"""What every ``tandem`` sub-command shares: our errors end a command with their message (exit 1),
and settings that fail validation with one line per field (exit 2, as for a bad flag), not a
traceback; one log format; SIGTERM unwinds like Ctrl-C. Each package's own ``cli.py`` uses these,
and ``tandem.cli`` mounts those sub-commands."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import typer
from pydantic import ValidationError
from rich.console import Console

from contracts.errors import TandemError

console = Console(stderr=True)


@contextlib.contextmanager
def clean_errors() -> Iterator[None]:
    """Our own errors end the command with their message, not a traceback."""
    try:
        yield
    except TandemError as exc:
        console.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from exc
    except ValidationError as exc:  # a settings object refused its values (flags or TANDEM_* variables)
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or exc.title
            console.print(f"[red]error:[/red] {where}: {err['msg'].removeprefix('Value error, ')}", highlight=False)
        raise typer.Exit(2) from exc


def interrupt(*_: object) -> None:
    """A signal handler that unwinds like Ctrl-C (``signal.signal(SIGTERM, interrupt)``)."""
    raise KeyboardInterrupt


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise
