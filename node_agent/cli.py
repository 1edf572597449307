"""``tandem node``: run one vLLM engine for a role and keep it registered until stopped.

Every option defaults to unset, so ``NodeSettings`` fills it from ``TANDEM_NODE_<FIELD>`` (and the Redis
URL from ``TANDEM_REDIS_URL``) or its own default: the environment is never silently overridden."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer

from contracts.cli import clean_errors, setup_logging
from contracts.registry import Role
from kv_transfer import ConnectorKind

_Role = Annotated[
    Role | None,
    typer.Option(
        help="prefill: computes prompts and ships their KV; decode: loads "
        "KV and generates; both (default): colocated, no transfer."
    ),
]

_Model = Annotated[
    str | None, typer.Option(help="Hugging Face model folder (default: the prepared SmolLM2-135M-Instruct).")
]

_ServedModelName = Annotated[
    str | None, typer.Option(help="Name clients put in `model` (default: the model folder's name).")
]

_Port = Annotated[
    int | None,
    typer.Option(
        help="Engine HTTP port (default 8100); port+1..port+3 are its "
        "KV-event, event-replay and NIXL side-channel ports."
    ),
]

_NodeId = Annotated[str | None, typer.Option(help="Registry id (default: host name + random suffix).")]

_RedisUrl = Annotated[str | None, typer.Option(help="Registry Redis (default: $TANDEM_REDIS_URL).")]

_Connector = Annotated[
    ConnectorKind | None,
    typer.Option(
        help="KV connector (prefill/decode roles): tandem (ours, default), nixl (vLLM's NixlConnector, the "
        "baseline) or none."
    ),
]

_Dtype = Annotated[
    str | None,
    typer.Option(
        help="auto (default: bfloat16 where the CPU has native bf16, else float32), bfloat16, or float32 "
        "(bit-stable greedy output)."
    ),
]

_KvCacheGib = Annotated[
    int | None, typer.Option(help="KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE; default 1).")
]

_Cores = Annotated[str | None, typer.Option(help="CPU cores for the engine, e.g. 0 or 0-1.")]

_MaxModelLen = Annotated[int | None, typer.Option(help="Context window in tokens (default 8192).")]

_BlockSize = Annotated[int | None, typer.Option(help="KV block size (default: the engine's).")]

_ToolCallParser = Annotated[
    str | None, typer.Option(help="vLLM tool-call parser (default pythonic; '' turns tools off).")
]

_EngineArg = Annotated[list[str] | None, typer.Option(help="Extra `vllm serve` argument (repeatable).")]

_HostTier = Annotated[
    str | None,
    typer.Option(help="Host tier control socket (`tandem tier serve`), e.g. ipc:///tmp/tandem-tier.sock."),
]

_PeerKv = Annotated[
    bool | None,
    typer.Option(
        "--peer-kv/--no-peer-kv",
        help="Role both: run our KV connector too, so peers load the prefixes this engine holds (and it "
        "theirs) instead of computing them (the router's peer fetch). Default: off.",
    ),
]

_LogDir = Annotated[Path | None, typer.Option(help="Write the engine's log here.")]


def node(
    role: _Role = None,
    model: _Model = None,
    served_model_name: _ServedModelName = None,
    port: _Port = None,
    node_id: _NodeId = None,
    redis_url: _RedisUrl = None,
    connector: _Connector = None,
    dtype: _Dtype = None,
    kv_cache_gib: _KvCacheGib = None,
    cores: _Cores = None,
    max_model_len: _MaxModelLen = None,
    block_size: _BlockSize = None,
    tool_call_parser: _ToolCallParser = None,
    engine_arg: _EngineArg = None,
    host_tier: _HostTier = None,
    peer_kv: _PeerKv = None,
    log_dir: _LogDir = None,
    log_level: str = "info",
) -> None:
    """Run one vLLM engine for a role and keep it registered (heartbeats) until stopped."""
    from node_agent.node import run_node
    from node_agent.settings import NodeSettings

    setup_logging(log_level)
    given: dict[str, Any] = dict(
        role=role,
        model=model,
        served_model_name=served_model_name,
        port=port,
        node_id=node_id,
        redis_url=redis_url,
        connector=connector,
        dtype=dtype,
        kv_cache_gib=kv_cache_gib,
        cores=cores,
        max_model_len=max_model_len,
        block_size=block_size,
        extra_engine_args=engine_arg,
        host_tier_endpoint=host_tier,
        peer_kv=peer_kv,
        log_dir=log_dir,
    )
    kwargs = {k: v for k, v in given.items() if v is not None}
    if tool_call_parser is not None:
        kwargs["tool_call_parser"] = tool_call_parser or None
    with clean_errors():
        raise typer.Exit(asyncio.run(run_node(NodeSettings(**kwargs))))
