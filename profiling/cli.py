"""``tandem profile --url URL --kind both --out profiles/P.json`` or ``tandem profile --launch 2 ...``
(mounted by ``tandem/cli.py``): measure an engine, fit the step model, write a profile the simulator and
``tandem plan --profile`` load."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import httpx
import typer

from contracts.registry import Role
from contracts.secret import engine_auth_headers
from infra.launcher import Cluster, ClusterSpec
from profiling.fit import fit_step_model
from profiling.measure import Sweep, measure
from simulator.step_model import Profile


@contextlib.contextmanager
def _launched(n: int, kv_cache_gib: int, block_size: int, workdir: Path) -> Iterator[str]:
    spec = ClusterSpec(
        prefill=0,
        decode=0,
        both=n,
        kv_cache_gib=kv_cache_gib,
        block_size=block_size or None,
        workdir=workdir,
        routers=1,
    )
    cluster = Cluster(spec)
    try:
        cluster.start()
        cluster.wait_ready(on_progress=lambda m: typer.echo(f"starting {n} colocated nodes… {m}"))
        # the first node's own engine: through the router a batch of streams would be spread over the
        # nodes, and a decode point would not be one engine's step
        yield cluster.role_urls(Role.BOTH.value)[0]
    finally:
        cluster.stop()


def profile_cmd(
    out: Annotated[Path, typer.Option(help="Profile to write (JSON).")],
    url: Annotated[str | None, typer.Option(help="A running node or router to measure.")] = None,
    launch: Annotated[
        int,
        typer.Option(
            help="Start this many colocated nodes instead of --url and measure the first one's engine "
            "(the others alive, sharing the cores)."
        ),
    ] = 0,
    kind: Annotated[str, typer.Option(help="Node kind the profile is for: both, prefill or decode.")] = "both",
    kv_cache_gib: Annotated[int, typer.Option(help="KV cache of launched nodes, GiB.")] = 1,
    block_size: Annotated[
        int, typer.Option(help="KV block size of launched nodes (0: the engine's default; CPU wants a multiple of 32).")
    ] = 0,
    quick: Annotated[bool, typer.Option(help="A smaller sweep (fewer lengths and batches).")] = False,
) -> None:
    """Measure prefill time against uncached tokens and decode step against batch and context on a real
    engine, fit the simulator's step model (non-negative least squares), write the profile."""
    role = Role(kind)
    # quick: prompts short enough for this 2-core machine, where a loaded engine prefills ~35 tokens/s and
    # the node agent calls an engine that makes no token for 31 s hung
    quick_sweep = Sweep(
        prefill_tokens=(32, 128, 384),
        repeats=2,
        batches=(1, 4),
        contexts=(128,),
        mixed_prefill=(),
        unshared=(),
        decode_tokens=24,
    )
    sweep = quick_sweep if quick else Sweep()
    if not url and not launch:
        raise typer.BadParameter("give --url or --launch N")
    with contextlib.ExitStack() as stack:
        target = url or stack.enter_context(_launched(launch, kv_cache_gib, block_size, Path(".tandem/profile")))
        headers = {} if url else engine_auth_headers(loopback_only=True)
        models = httpx.get(f"{target.rstrip('/')}/v1/models", headers=headers, timeout=30).json()
        model = models["data"][0]["id"]
        pts = asyncio.run(measure(target, model, sweep, headers=headers, progress=typer.echo))
    what = f"measured {model} at {target}" + (f" ({launch} colocated nodes alive)" if launch else "")
    step, err = fit_step_model(pts.prefill, pts.decode, pts.mixed, source=what)
    prof = Profile(
        models={role: step},
        description=what + "; transfer coefficients not measured (defaults)",
        measurements={
            "prefill": [asdict(p) for p in pts.prefill],
            "decode": [asdict(d) for d in pts.decode],
            "mixed": [asdict(m) for m in pts.mixed],
            "fit_rel_rms": err,
        },
    )
    prof.save(out)
    typer.echo(
        f"{kind}: base {step.base_s * 1e3:.2f} ms, prefill {step.prefill_s_per_token * 1e6:.1f} us/token, "
        f"decode {step.decode_s_per_seq * 1e3:.3f} ms/seq + {step.decode_s_per_ctx_token * 1e9:.2f} ns/ctx token "
        f"+ {step.decode_s_per_kv_token * 1e9:.2f} ns/KV token held; {len(pts.mixed)} mixed steps; "
        f"fit relative RMS {err:.1%}; wrote {out}"
    )
