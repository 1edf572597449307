"""``tandem replay TRACE --url URL`` (mounted by ``tandem/cli.py``)::

    tandem replay T.parquet --url http://127.0.0.1:8000 [--mode open|closed] [--speed 1]
        [--out replay.parquet] [--limit N] [--model M] [--context-window N] [--block-size 16]
        [--unit-tokens U] [--api-key K] [--sessions/--no-sessions] [--vocab 1000:32000]

The model and its context window come from the server's ``GET /v1/models`` unless given. The
rescaling (``replay.plan``) and the summary (``replay.results``) are printed; the per-request results
go to ``--out``.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Annotated

import httpx
import typer

from contracts.cli import clean_errors
from contracts.errors import UpstreamError
from replay.plan import plan
from replay.results import render, summarize, to_table, write_results
from replay.runner import Mode, ReplaySettings, run
from traces.hashing import TraceError
from traces.schema import read_trace


def _model_info(url: str, api_key: str | None, model: str | None) -> tuple[str, int | None]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        data = resp.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise UpstreamError(f"cannot list the models at {url}: {exc}") from exc
    if not data:
        raise UpstreamError(f"{url} serves no model")
    entry = next((m for m in data if m.get("id") == model), None) if model else data[0]
    if entry is None:
        raise TraceError(f"{url} does not serve {model!r} (it serves {[m.get('id') for m in data]})")
    return entry["id"], entry.get("max_model_len")


def _vocab(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise typer.BadParameter(f"--vocab takes LO:HI, got {text!r}") from exc
    if not 0 <= lo < hi:
        raise typer.BadParameter(f"--vocab needs 0 <= LO < HI, got {text!r}")
    return lo, hi


def replay(
    trace_file: Annotated[Path, typer.Argument(help="Trace file (Parquet, `tandem trace ...`).")],
    url: Annotated[str, typer.Option(help="Base URL of the router (or any OpenAI-compatible server).")],
    mode: Annotated[Mode, typer.Option(help="open: by timestamps; closed: per session, answer + gap.")] = Mode.OPEN,
    speed: Annotated[float, typer.Option(help="Time compression (2: twice as fast).")] = 1.0,
    out: Annotated[Path, typer.Option(help="Per-request results (Parquet).")] = Path("replay.parquet"),
    limit: Annotated[int | None, typer.Option(min=1, help="Replay only the first N requests (by arrival).")] = None,
    model: Annotated[str | None, typer.Option(help="Model to ask for (default: the server's first).")] = None,
    context_window: Annotated[int | None, typer.Option(help="Tokens (default: the model's max_model_len).")] = None,
    block_size: Annotated[int, typer.Option(help="The engines' KV block size, tokens.")] = 16,
    unit_tokens: Annotated[int | None, typer.Option(help="Trace tokens per sent block (default: fit).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="TANDEM_API_KEY", help="Bearer key.")] = None,
    sessions: Annotated[bool, typer.Option(help="Name each session in x-session-id.")] = True,
    vocab: Annotated[str, typer.Option(help="Token ids are drawn from LO:HI.")] = "1000:32000",
) -> None:
    """Replay a trace against a cluster over SSE; results to Parquet, hit rate next to the ceiling."""
    with clean_errors():
        trace = read_trace(trace_file)
        if limit is not None:
            trace = type(trace)(trace.table.slice(0, limit), trace.meta)
        model_name, window = _model_info(url, api_key, model)
        window = context_window or window
        if window is None:
            raise TraceError("the server does not say its context window: give --context-window")
        planned, scaling = plan(
            trace, block_size=block_size, context_window=window, unit_tokens=unit_tokens, vocab=_vocab(vocab)
        )
        typer.echo(f"replaying {len(planned)} requests of {trace.meta.source} against {url} ({model_name})")
        typer.echo(f"rescaling: {scaling.describe()}")
        settings = ReplaySettings(
            url=url,
            model=model_name,
            mode=mode,
            speed=speed,
            api_key=api_key,
            session_prefix=f"replay-{uuid.uuid4().hex[:8]}-" if sessions else None,
        )
        results = asyncio.run(run(planned, settings))
        table = to_table(results)
        write_results(
            table,
            out,
            {
                "trace": trace.meta.source,
                "url": url,
                "mode": mode.value,
                "speed": str(speed),
                "scaling": scaling.describe(),
            },
        )
    typer.echo(render(summarize(table)))
    typer.echo(f"results: {out}")
