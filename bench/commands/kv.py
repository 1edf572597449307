"""The benchmarks of KV movement and KV reuse: ``kv-transfer`` (transfer time and GB/s per transport, on
real engines or, ``--standalone``, on KV caches of real models' shapes) and ``kv-cache`` (the host tier and
session retention against the engines alone and against a bigger engine cache).

Each command only turns its options into the benchmark's config, runs it under ``clean_errors`` and prints
its ``RESULT`` line; the benchmark module (imported inside the command, so ``tandem --help`` stays fast)
starts and stops what it measures. ``bench.cli`` registers the commands, in the order ``--help`` lists them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bench.commands.options import Out, RedisUrl
from contracts.cli import clean_errors
from contracts.config import redis_url as _redis_url


def bench_kv_transfer(
    out: Out = Path("results/bench-kv-transfer.json"),
    size: Annotated[
        list[int] | None, typer.Option(help="Prompt sizes in tokens (repeatable; default 1000, 4000, 7500).")
    ] = None,
    repeats: Annotated[
        int, typer.Option(help="Layer-wise pairs (each a real prefill) per size and transport, and TTFT requests.")
    ] = 3,
    pull_repeats: Annotated[
        int, typer.Option(help="Whole pulls per size and transport (prefix-cache hits; their median is the GB/s).")
    ] = 7,
    nixl: Annotated[bool, typer.Option(help="Also measure NixlConnector (default UCX and UCX_TLS=tcp).")] = True,
    ttft_tokens: Annotated[int, typer.Option(help="Prompt tokens of the TTFT P/D-vs-colocated comparison.")] = 1000,
    dtype: Annotated[
        str,
        typer.Option(
            help="Engine dtype: auto (bfloat16, the model's own, on CPUs with bfloat16 instructions; "
            "float32 on AVX2-only CPUs, where bfloat16 prefills run ~5x slower), bfloat16 or float32 "
            "(twice the bytes per token)."
        ),
    ] = "auto",
    redis_url: RedisUrl = None,
    device: Annotated[
        str, typer.Option(help="KV caches' device for --standalone: cuda, cuda:N, or cpu (a rehearsal).")
    ] = "cpu",
    standalone: Annotated[
        bool,
        typer.Option(
            help="No engines: our connector's halves on KV caches of real models' shapes in two processes "
            "(infra/device/kv_cuda_bench.py; the only way to measure CUDA caches where vLLM is absent)."
        ),
    ] = False,
) -> None:
    """KV transfer time and GB/s per transport (our ZeroMQ tcp and ipc, shared-memory copy and UCX;
    NixlConnector default and over tcp) on real engines, against an in-process memcpy, plus TTFT P/D vs
    colocated. Starts and stops its own clusters, one at a time."""
    redis_url = redis_url or _redis_url(db=9)
    from bench.kv_transfer import KvBenchConfig, run_device_bench, run_kv_transfer_bench

    if standalone:
        with clean_errors():
            run_device_bench(device, out)
        return
    if device != "cpu":
        raise typer.BadParameter("engines on a GPU are not benchmarked here: add --standalone", param_hint="--device")
    cfg = KvBenchConfig(
        sizes=tuple(size or (1000, 4000, 7500)),
        repeats=repeats,
        pull_repeats=pull_repeats,
        nixl=nixl,
        redis_url=redis_url,
        ttft_tokens=ttft_tokens,
        dtype=dtype,
    )
    with clean_errors():
        run_kv_transfer_bench(out, cfg)


def bench_kv_cache(
    out: Out = Path("results/bench-kv-cache.json"),
    nodes: Annotated[int, typer.Option(help="Colocated nodes sharing the host's tier (at least 2).", min=2)] = 4,
    node_blocks: Annotated[int, typer.Option(help="Engine KV blocks per node (32 tokens each).")] = 96,
    tier_mib: Annotated[int, typer.Option(help="Host tier size, MiB (the bigger_cache arm splits it).")] = 192,
    pin_share: Annotated[
        float, typer.Option(help="Share of the tier the bench's one tenant may pin (retention's budget).")
    ] = 0.5,
    sessions_per_repo: Annotated[
        int | None, typer.Option(help="Agent sessions per repository, started 5 s apart (default: 3).")
    ] = None,
    think_s: Annotated[
        float | None, typer.Option(help="Mean tool pause between an answer and the next turn, s (default: 12).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Workload seed (the content is salted per arm anyway).")] = 7,
    arms: Annotated[
        str, typer.Option(help="Comma-separated arms to run: engines, tier, bigger_cache, retention.")
    ] = "engines,tier,bigger_cache,retention",
    probes: Annotated[
        int, typer.Option(help="Fresh prefixes probed for TTFT by origin at the end of the tier arm (0: none).")
    ] = 5,
    smoke: Annotated[
        bool,
        typer.Option(help="A small workload (2 repositories x 2 sessions, short pauses, 2 probes): checks it runs."),
    ] = False,
    redis_url: RedisUrl = None,
) -> None:
    """Host tier and session retention against the engines alone and against giving the engines the
    tier's memory as KV cache, on agent sessions whose shared context outgrows one node's cache, with
    tool pauses; the unlimited-cache ceiling alongside. Four arms of 4 fresh colocated nodes each
    (``--nodes``), ~20-25 min on 2 cores. The last line is RESULT ceiling_hit=… engines_hit=… bigger_cache_hit=…
    tier_hit=… retention_hit=… engines_ttft_p50_ms=… tier_ttft_p50_ms=… local_hit_ttft_ms=…
    remote_hit_ttft_ms=… miss_ttft_ms=…"""
    from dataclasses import replace

    from bench.kv_cache import ARMS, KVCacheBenchConfig, result_line, run_kv_cache_bench, smoke_workload

    chosen = tuple(a.strip() for a in arms.split(",") if a.strip())
    unknown = sorted(set(chosen) - set(ARMS))
    if unknown or not chosen:
        raise typer.BadParameter(f"unknown arms {unknown}: choose from {', '.join(ARMS)}", param_hint="--arms")
    base = KVCacheBenchConfig()
    workload = smoke_workload() if smoke else base.workload
    workload = replace(
        workload,
        sessions_per_repo=sessions_per_repo or workload.sessions_per_repo,
        think_s=workload.think_s if think_s is None else think_s,
        seed=seed,
    )
    cfg = replace(
        base,
        nodes=nodes,
        node_blocks=node_blocks,
        tier_mib=tier_mib,
        pin_share=pin_share,
        arms=chosen,
        probes=min(probes, 2) if smoke else probes,
        workload=workload,
        redis_url=redis_url or _redis_url(db=6),
    )
    with clean_errors():
        s = run_kv_cache_bench(out, cfg)
    print(result_line(s), flush=True)
