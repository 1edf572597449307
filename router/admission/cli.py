"""``tandem keys``: create, list and revoke API keys. Reads the same ``TANDEM_*`` settings as the router
(``TANDEM_REDIS_URL``, ``TANDEM_DATABASE_URL`` / ``TANDEM_SQLITE_PATH``, ``TANDEM_KEY_PREFIX``)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from contracts.errors import TandemError
from router.admission.context import AdmissionContext, AdmissionSettings
from router.admission.keys import ApiKeyInfo
from router.admission.priority_class import Priority

T = TypeVar("T")

keys_app = typer.Typer(
    name="keys",
    help="Manage API keys. The first key created turns authentication on (TANDEM_AUTH=auto).",
    no_args_is_help=True,
)


def _run(work: Callable[[AdmissionContext], Awaitable[T]]) -> T:
    async def main() -> T:
        ctx = await AdmissionContext.create(AdmissionSettings.from_env(), start_writer=False)
        try:
            return await work(ctx)
        finally:
            await ctx.close()

    try:
        return asyncio.run(main())
    except TandemError as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from exc


def _limit(n: int) -> str:
    return "unlimited" if n == 0 else f"{n:,}"


@keys_app.command("create")
def create(
    tenant: Annotated[str, typer.Option("--tenant", "-t", help="Tenant id ([A-Za-z0-9._-], created if new).")],
    rpm: Annotated[int | None, typer.Option(help="Requests per minute for the tenant (0 = unlimited).")] = None,
    tpm: Annotated[int | None, typer.Option(help="Tokens per minute for the tenant (0 = unlimited).")] = None,
    priority: Annotated[
        Priority | None,
        typer.Option(
            help="Priority class of the tenant's requests (a request's x-tandem-priority header may "
            "lower it to batch, never raise it).",
            case_sensitive=False,
        ),
    ] = None,
    admin: Annotated[
        bool,
        typer.Option(
            "--admin", help="An admin key: may read /metrics and /cluster and send x-tandem-route and x-tandem-node."
        ),
    ] = False,
) -> None:
    """Create a key for TENANT and print it once: it is stored only as a hash and cannot be shown again.

    Limits and priority apply to the whole tenant; given for an existing tenant, they replace its
    current ones. Defaults for a new tenant: TANDEM_DEFAULT_RPM, TANDEM_DEFAULT_TPM, interactive.
    """

    async def work(ctx: AdmissionContext) -> tuple[ApiKeyInfo, str]:
        s = ctx.settings
        return await ctx.keys.create_key(
            tenant,
            rpm=rpm,
            tpm=tpm,
            priority=priority,
            default_rpm=s.default_rpm,
            default_tpm=s.default_tpm,
            admin=admin,
        )

    info, key = _run(work)
    err = Console(stderr=True)
    err.print(
        f"created key [bold]{info.key_id}[/bold] for tenant [bold]{info.tenant_id}[/bold] "
        f"(rpm {_limit(info.rpm)}, tpm {_limit(info.tpm)}, {info.priority}{', admin' if info.admin else ''}). "
        "Store it now; it will not be shown again:"
    )
    typer.echo(key)


@keys_app.command("list")
def list_keys(
    tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="Only this tenant's keys.")] = None,
) -> None:
    """List keys (id, tenant, limits, class, state). Keys and their hashes are never shown."""
    rows = _run(lambda ctx: ctx.keys.list_keys(tenant))
    table = Table(title="API keys")
    for col in ("key id", "tenant", "req/min", "tokens/min", "class", "state", "created (UTC)"):
        table.add_column(col)
    for k in rows:
        created = dt.datetime.fromtimestamp(k.created_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        state = "[red]revoked[/red]" if k.revoked else "[green]active[/green]"
        if k.admin:
            state += " admin"
        table.add_row(k.key_id, k.tenant_id, _limit(k.rpm), _limit(k.tpm), str(k.priority), state, created)
    Console().print(table)


@keys_app.command("revoke")
def revoke(key_id: Annotated[str, typer.Argument(help="The key id shown by `tandem keys list`.")]) -> None:
    """Revoke a key: requests with it get 401 from now on. Auth stays on even if no active key remains."""
    info = _run(lambda ctx: ctx.keys.revoke(key_id))
    typer.echo(f"revoked key {info.key_id} of tenant {info.tenant_id}")
