"""``tandem router``: the OpenAI-compatible API over the nodes in the registry.

Every option defaults to unset, so ``RouterSettings`` fills it from ``TANDEM_ROUTER_<FIELD>`` (and the
Redis URL from ``TANDEM_REDIS_URL``) or its own default."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from contracts.cli import clean_errors, setup_logging
from router.policies import PolicyName


def router(
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1, loopback).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port of the OpenAI-compatible API (default 8000).")] = None,
    redis_url: Annotated[str | None, typer.Option(help="Registry Redis (default: $TANDEM_REDIS_URL).")] = None,
    policy: Annotated[PolicyName | None, typer.Option(help="Routing policy (default cache_aware).")] = None,
    models: Annotated[
        Path | None,
        typer.Option(help="Models file: aliases, fallbacks, canaries (TOML; default: $TANDEM_ROUTER_MODELS, none)."),
    ] = None,
    reuse_port: Annotated[
        bool | None,
        typer.Option(
            "--reuse-port/--no-reuse-port",
            help="Share the port with other router replicas on this host (SO_REUSEPORT; default off).",
        ),
    ] = None,
    layerwise: Annotated[
        bool | None,
        typer.Option(
            "--layerwise/--no-layerwise",
            help="Send a P/D pair's legs at once, the KV pulled layer by layer during the prefill "
            "(default on; $TANDEM_ROUTER_LAYERWISE).",
        ),
    ] = None,
    log_level: str = "info",
) -> None:
    """Run the router: OpenAI API (SSE), P/D orchestration over the nodes in the registry.

    Keys, limits, sessions and admission queues read TANDEM_* environment variables (see README), e.g.:

    TANDEM_ROUTER_NODE_MAX_CONCURRENCY: requests sent to one node at once, the rest queue by class (64).

    TANDEM_ROUTER_NODE_MAX_QUEUE: queued requests per node before batch, then interactive, is shed with 503 (256).

    TANDEM_REQUEST_DEADLINE_S: default wait for a node slot before a request is dropped unserved (30).

    TANDEM_ROUTER_CPU_PRIORITY: batch (default: a wake-up never preempts an engine thread), normal, idle.

    Request headers: x-tandem-priority (interactive|batch; lowers the key's class, never raises it),
    x-tandem-deadline-ms, x-session-id, x-tandem-history (client|server)."""
    from router.huge_pages import restart_on_huge_pages
    from router.settings import RouterSettings

    setup_logging(log_level)
    given: dict[str, Any] = dict(
        host=host,
        port=port,
        redis_url=redis_url,
        policy=policy,
        models=models,
        reuse_port=reuse_port,
        layerwise=layerwise,
    )
    settings = RouterSettings(**{k: v for k, v in given.items() if v is not None})
    restart_on_huge_pages(settings.huge_pages)  # before anything is opened: it may replace this process
    from router.edge.app import create_app
    from router.edge.server import serve

    with clean_errors():
        app_ = create_app(settings)
    serve(
        app_,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        reuse_port=settings.reuse_port,
        cpu_priority=settings.cpu_priority,
        keep_alive_s=settings.keep_alive_s,
    )
