"""`tandem bench kv-transfer`: how fast KV moves from a prefill to a decode engine, per transport, on
real engines, against NixlConnector and an in-process memcpy of the same bytes.

For prompts of about 1k, 4k and 7.5k tokens (fresh text each time, so no prefix cache shortens a
transfer), the bench runs the two legs itself, straight to the engines: a prefill request that leases
its blocks, then a decode request carrying the prefill's kv_transfer_params. With our connector the
decode request names the transport (``kv_transfer_params["transport"]``: tcp, ipc, shm, ucx), so one
cluster measures all four. Transfer time and bytes come from the decode engine's own metrics
(``tandem_kv_transfer_seconds`` / ``_bytes``; NIXL's ``vllm:nixl_xfer_time_seconds`` /
``vllm:nixl_bytes_transferred``), read before and after each request.

Clusters, one after the other (never two at once: two cores):
  1. tandem connector: 1 prefill + 1 decode + 1 colocated node (TTFT P/D vs colocated through the
     router, and the three transports);
  2. NixlConnector as configured by default (UCX picks its transports);
  3. NixlConnector with UCX_TLS=tcp (the cross-host baseline).
The memcpy ceiling copies the same number of bytes, in blocks of the engine's block size, between two
arrays in this process.

Two more figures per transport, from our connector's own report (the decode leg's
``kv_transfer_params["tandem_transfer"]``, wall clock on this one host):
  - exposed transfer time: from the prefill leg's answer (the prefill has ended) to the decode engine
    having every block (the end of its pull), at every size: what the transfer adds to the first
    token. ``exposed_whole_ms``: the pull after the prefill (the prefill leg a prefix-cache hit, as
    for the GB/s figures). ``exposed_layerwise_ms``: both legs sent at once and the layers pulled
    while the prefill computes them (``LAYERWISE_TRANSPORTS``; both caches emptied first, so every
    such sample is a real prefill).
  - the fixed cost per pull: a 1-block prompt's pull (``PULL_FIXED_TOKENS``), timed by the decode
    engine from the hand-over to its pull thread to every block in place (its own report's
    ``seconds``, the figure its ``tandem_kv_transfer_seconds`` adds up). ``PULL_FIXED_REPEATS`` pulls
    per transport, the transports in turn so that drift on a shared host falls on all of them alike,
    after ``PULL_FIXED_WARMUP`` pulls each that are not counted; the median, with its quartiles
    beside it (``pull_fixed_spread_ms`` and the RESULT's ``pull_fixed_p25_ms``/``_p75_ms``).

Last line: ``RESULT best_gbps=... memcpy_gbps=... nixl_gbps=... tcp_gbps=... nixl_tcp_gbps=...
ttft_pd_ms=... ttft_colo_ms=... exposed_whole_ms=... exposed_layerwise_ms=... pull_fixed_ms=...
ttft_pd_layerwise_ms=... ttft_pd_sequential_ms=... pull_fixed_p25_ms=... pull_fixed_p75_ms=...``
(transfer figures at the largest prompt and, for exposed and fixed, on the best transport there;
``ttft_pd``/``ttft_colo`` at ``ttft_tokens``; ``ttft_pd_layerwise``/``_sequential``: P/D TTFT through
the router at the largest prompt, its pairs layer-wise against sequential, measured through two
routers over the same nodes, request by request in turn; last, the quartiles of ``pull_fixed_ms``).
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from bench.kv_transfer_results import (
    TRANSPORTS,
    Sample,
    block_nbytes_of,
    plot,
    quartiles,
    summarise,
)
from bench.loadgen import run_level
from bench.procs import environment
from contracts.config import redis_url as configured_redis_url
from contracts.secret import engine_auth_headers
from contracts.transfer import LAYERWISE_ID_KEY, TransferParams
from infra.launcher import Cluster, ClusterSpec
from kv_transfer import prefill_request_params
from kv_transfer.config import LAYERWISE_TRANSPORTS as LAYERWISE
from kv_transfer.config import TransportName
from node_agent.dtype import resolve_dtype

console = Console(stderr=True)

PULL_FIXED_TOKENS = 60
"""Prompt size of the fixed-cost pulls: ~90 tokens with the chat-free prompt below, one 128-token block."""
PULL_FIXED_REPEATS = 25
PULL_FIXED_WARMUP = 2
"""Pulls per transport before the counted ones: a pool thread's first pull to an endpoint connects
its socket, and the first shm pull learns the prefill process; neither is a fixed cost per pull."""
LAYERWISE_TRANSPORTS = tuple(t.value for t in TransportName if t in LAYERWISE)


@dataclass(frozen=True)
class KvBenchConfig:
    sizes: tuple[int, ...] = (1000, 4000, 7500)
    """Approximate prompt tokens."""
    repeats: int = 3
    """Layer-wise pairs per size and transport (each a real prefill), and TTFT requests."""
    pull_repeats: int = 7
    """Whole pulls per size and transport. Each is cheap (its prefill leg is a prefix-cache hit), and
    their median is the GB/s figure: on a shared 2-core host a single pull can take twice its usual
    time, so a median of three moved by tens of percent between runs."""
    redis_url: str = field(default_factory=lambda: configured_redis_url(db=9))
    """$TANDEM_REDIS_URL's server, database 9: the benchmark's own."""
    router_port: int = 18500
    node_base_port: int = 18600
    dtype: str = "auto"
    """As the nodes resolve it (``node_agent.dtype``): the model's bfloat16 where the CPU has bfloat16
    instructions, float32 where it has only AVX2 (bfloat16 matmuls there run ~5x slower: a 1k-token
    prefill took ~30 s on this project's 2-core AVX2 host, a 7.5k one minutes). Resolved before the
    run, so the JSON says which it was."""
    kv_cache_gib: int = 2
    nixl: bool = True
    ttft_tokens: int = 1000
    """Prompt size of the TTFT comparison (fresh prompts, no cache): a 7.5k-token prefill takes minutes
    on one CPU core, so the default compares at 1k; on real hardware pass the largest size."""


def prompt_text(tokens: int, tag: str) -> str:
    """About ``tokens`` tokens of code-like text (the default tokenizer gives ~3 tokens per item here),
    opened by a unique tag so no cache anywhere has seen its first block."""
    items = " ".join(f"v{i % 89}" for i in range(int(tokens / 2.9)))
    return f"[{tag}] Continue this sequence: {items}"


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


@dataclass
class Legs:
    tokens: int
    """The prompt's token count."""
    exposed_s: float | None
    """Prefill leg answered → the decode engine's pull ended (None: no report, e.g. NIXL)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The prefill leg's kv_transfer_params (where its block server is)."""
    report: dict[str, Any] = field(default_factory=dict)
    """The decode engine's report of its pull (``tandem_transfer``; empty without one, e.g. NIXL)."""


def _two_legs(
    prefill: str, decode: str, model: str, prompt: str, transport: str | None, nixl: bool, client: httpx.Client
) -> Legs:
    """One P/D request done by hand."""
    params: dict[str, Any] = prefill_request_params()
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    first = client.post(f"{prefill}/v1/completions", json={**body, "kv_transfer_params": params})
    first.raise_for_status()
    prefill_end = time.time()  # the same clock as the decode engine's report: one host
    kv = first.json()["kv_transfer_params"]
    if transport and not nixl:
        kv["transport"] = transport
    second = client.post(f"{decode}/v1/completions", json={**body, "kv_transfer_params": kv})
    second.raise_for_status()
    report = (second.json().get("kv_transfer_params") or {}).get("tandem_transfer") or {}
    exposed = report["end"] - prefill_end if report.get("ok") and report.get("end") else None
    return Legs(first.json()["usage"]["prompt_tokens"], exposed, first.json()["kv_transfer_params"], report)


def _layerwise_legs(
    prefill: str, decode: str, model: str, prompt: str, transport: str, where: dict[str, Any], client: httpx.Client
) -> Legs:
    """Both legs at once, as layer-wise transfer has them: the decode leg first, with params naming the
    prefill node's block server (``where``: an earlier prefill leg's params) and a transfer id of our
    choosing, then the prefill leg under that id. The decode node pulls each layer while the prefill
    computes it."""
    tid = f"lw-{uuid.uuid4().hex}"
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    pull = TransferParams(
        transfer_id=tid,
        remote_block_ids=[],
        remote_endpoints=where["remote_endpoints"],
        remote_host_id=where["remote_host_id"],
        remote_engine_id=where["remote_engine_id"],
        remote_num_tokens=0,
        lease_deadline=time.time() + 3600,  # a layer-wise lease has no deadline before its prefill ends
        transport=transport,
        layerwise=True,
    ).to_dict()
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(client.post, f"{decode}/v1/completions", json={**body, "kv_transfer_params": pull})
        first = client.post(
            f"{prefill}/v1/completions",
            json={**body, "kv_transfer_params": {**prefill_request_params(), LAYERWISE_ID_KEY: tid}},
        )
        first.raise_for_status()
        prefill_end = time.time()
        answer = second.result()
    answer.raise_for_status()
    report = (answer.json().get("kv_transfer_params") or {}).get("tandem_transfer") or {}
    exposed = report["end"] - prefill_end if report.get("ok") and report.get("end") else None
    return Legs(first.json()["usage"]["prompt_tokens"], exposed)


def _reset_prefix_cache(url: str, client: httpx.Client) -> None:
    """Empty an engine's prefix cache (vLLM's dev endpoint; the bench runs its engines with
    VLLM_SERVER_DEV_MODE=1), so the next pull into it moves every block of the prompt."""
    resp = client.post(f"{url}/reset_prefix_cache")
    resp.raise_for_status()


def measure_transfers(
    cluster: Cluster,
    model: str,
    cfg: KvBenchConfig,
    *,
    nixl: bool,
    label: str,
    transports: tuple[str | None, ...],
    sizes: tuple[int, ...] | None = None,
    repeats: int | None = None,
    pull_repeats: int | None = None,
    layerwise: tuple[str, ...] = (),
) -> list[Sample]:
    """Per size, the prompt is prefilled once; every measured pull after that reuses the prefill
    node's prefix cache (its prefill leg is a cache hit that still leases every block) while the decode
    node's cache is emptied before each pull, so each pull moves the whole prompt and a 7.5k-token
    prefill on one CPU core is paid once per size, not once per sample."""
    prefill, decode = cluster.role_urls("prefill")[0], cluster.role_urls("decode")[0]
    secs_name, bytes_name = (
        ("vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_bytes_transferred_sum")
        if nixl
        else ("tandem_kv_transfer_seconds_sum", "tandem_kv_transfer_bytes_total")
    )
    samples: list[Sample] = []
    repeats = cfg.repeats if repeats is None else repeats
    pull_repeats = cfg.pull_repeats if pull_repeats is None else pull_repeats
    # The legs go straight to the engines, which take only the cluster's engine key (contracts.secret).
    with httpx.Client(timeout=1800, headers=engine_auth_headers(loopback_only=True)) as client:
        for size in cfg.sizes if sizes is None else sizes:
            prompt = prompt_text(size, uuid.uuid4().hex)
            with console.status(f"{label}: prefilling {size} tokens once…"):
                where = _two_legs(prefill, decode, model, prompt, transports[0], nixl, client).params
            for transport in layerwise:
                for _ in range(repeats):  # a real prefill each time: the overlap is with its compute
                    _reset_prefix_cache(prefill, client)
                    _reset_prefix_cache(decode, client)
                    with console.status(f"layer-wise {transport}: prefilling {size} tokens…"):
                        legs = _layerwise_legs(prefill, decode, model, prompt, transport, where, client)
                    samples.append(Sample(f"layerwise-{transport}", legs.tokens, 0.0, 0.0, legs.exposed_s))
                    exposed = "failed" if legs.exposed_s is None else f"{legs.exposed_s * 1000:8.1f} ms"
                    console.print(f"{'layerwise-' + transport:>12} {legs.tokens:5d} tok  exposed {exposed}")
            for transport in transports:
                for _ in range(pull_repeats):
                    _reset_prefix_cache(decode, client)
                    s0, b0 = _metric(decode, secs_name), _metric(decode, bytes_name)
                    legs = _two_legs(prefill, decode, model, prompt, transport, nixl, client)
                    # the decode engine's metrics are updated from its stats stream: wait for this transfer
                    end = time.monotonic() + 30
                    while _metric(decode, bytes_name) == b0 and time.monotonic() < end:
                        time.sleep(0.2)  # metrics offer no notification
                    s1, b1 = _metric(decode, secs_name), _metric(decode, bytes_name)
                    name = label if transport is None else f"{label}-{transport}"
                    samples.append(Sample(name, legs.tokens, b1 - b0, s1 - s0, legs.exposed_s))
                    exposed = "" if legs.exposed_s is None else f"  exposed {legs.exposed_s * 1000:8.1f} ms"
                    console.print(
                        f"{name:>12} {legs.tokens:5d} tok  {(b1 - b0) / 1e6:8.1f} MB  "
                        f"{(s1 - s0) * 1000:8.1f} ms  {samples[-1].gbps:6.2f} GB/s{exposed}"
                    )
    return samples


def measure_fixed_pulls(cluster: Cluster, model: str, transports: tuple[str, ...]) -> list[Sample]:
    """The fixed cost per pull: 1-block pulls of one prompt (prefilled once; each pull after is a
    prefix-cache hit on the prefill node, the decode node's cache emptied first), the transports in
    turn, each pull timed by the decode engine's own report. A pull that failed or has no report is
    left out and said so (never counted as fast)."""
    prefill, decode = cluster.role_urls("prefill")[0], cluster.role_urls("decode")[0]
    samples: list[Sample] = []
    prompt = prompt_text(PULL_FIXED_TOKENS, uuid.uuid4().hex)
    with httpx.Client(timeout=600, headers=engine_auth_headers(loopback_only=True)) as client:
        _two_legs(prefill, decode, model, prompt, transports[0], False, client)
        for i in range(PULL_FIXED_WARMUP + PULL_FIXED_REPEATS):
            for transport in transports:
                _reset_prefix_cache(decode, client)
                legs = _two_legs(prefill, decode, model, prompt, transport, False, client)
                report = legs.report
                if not report.get("ok") or report.get("seconds") is None:
                    console.print(f"fixed-{transport}: pull {i} gave no transfer report ({report}); not counted")
                    continue
                if i >= PULL_FIXED_WARMUP:
                    samples.append(Sample(f"fixed-{transport}", legs.tokens, report["bytes"], report["seconds"]))
    for transport in transports:
        ms = sorted(s.seconds * 1000 for s in samples if s.transport == f"fixed-{transport}")
        if ms:
            q = quartiles(ms)
            console.print(
                f"{'fixed-' + transport:>12} {len(ms)} pulls of 1 block: median {statistics.median(ms):.2f} ms "
                f"(quartiles {q[0]:.2f}-{q[1]:.2f}, {ms[0]:.2f}-{ms[-1]:.2f})"
            )
    return samples


def ttft(cluster: Cluster, model: str, tokens: int, route: str, repeats: int) -> float:
    import asyncio

    prompts = [[{"role": "user", "content": prompt_text(tokens, uuid.uuid4().hex)}] for _ in range(repeats)]
    _, results = asyncio.run(run_level(cluster.url, model, prompts, 1, repeats, 8, headers={"x-tandem-route": route}))
    return statistics.median(r.ttft_s for r in results if r.ok) * 1000


def ttft_layerwise_vs_sequential(
    cluster: Cluster, model: str, tokens: int, repeats: int, port: int
) -> dict[str, float]:
    """P/D TTFT through the cluster's router (layer-wise pairs, its default) and through a second router
    over the same nodes with ``TANDEM_ROUTER_LAYERWISE=false``, alternating request by request (fresh
    prompts) so that drift on the shared host falls on both alike; medians in ms."""
    import asyncio

    sequential = cluster.add_router(port, None, name="router-sequential", env={"TANDEM_ROUTER_LAYERWISE": "false"})
    cluster.wait_router(sequential)
    got: dict[str, list[float]] = {"pd_layerwise": [], "pd_sequential": []}
    for _ in range(repeats):
        for key, url in (("pd_layerwise", cluster.url), ("pd_sequential", sequential)):
            prompt = [[{"role": "user", "content": prompt_text(tokens, uuid.uuid4().hex)}]]
            pd = {"x-tandem-route": "disaggregated"}
            _, results = asyncio.run(run_level(url, model, prompt, 1, 1, 8, headers=pd))
            got[key] += [r.ttft_s * 1000 for r in results if r.ok]
    return {k: statistics.median(v) for k, v in got.items() if v}


def _cluster(cfg: KvBenchConfig, workdir: Path, connector: str, both: int) -> Cluster:
    """Not started: ``_start`` starts it with progress on the console."""
    return Cluster(
        ClusterSpec(
            prefill=1,
            decode=1,
            both=both,
            router_port=cfg.router_port,
            node_base_port=cfg.node_base_port,
            redis_url=cfg.redis_url,
            dtype=cfg.dtype,
            kv_cache_gib=cfg.kv_cache_gib,
            connector=connector,
            workdir=workdir,
        )
    )


@contextmanager
def _started(cluster: Cluster, what: str) -> Any:
    """Start a cluster with progress on the console; yields the served model's name; always stops it.
    Its engines run with VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache."""
    try:
        with environment({"VLLM_SERVER_DEV_MODE": "1"}), console.status(f"starting {what} cluster…") as status:
            cluster.start()
            cluster.wait_ready(on_progress=lambda msg: status.update(f"{what}: {msg}"))
        yield httpx.get(f"{cluster.url}/v1/models").json()["data"][0]["id"]
    finally:
        cluster.stop()


def run_kv_transfer_bench(out: Path, cfg: KvBenchConfig | None = None) -> dict[str, Any]:
    cfg = cfg or KvBenchConfig()
    cfg = replace(cfg, dtype=resolve_dtype(cfg.dtype))
    console.print(f"engines in {cfg.dtype}")
    workdir = Path(".tandem") / "bench-kv-transfer"
    samples: list[Sample] = []
    ttfts: dict[str, float] = {}
    cluster = _cluster(cfg, workdir / "tandem", "tandem", both=1)
    with _started(cluster, "tandem") as model:
        samples += measure_transfers(
            cluster, model, cfg, nixl=False, label="tandem", transports=TRANSPORTS, layerwise=LAYERWISE_TRANSPORTS
        )
        fixed = measure_fixed_pulls(cluster, model, TRANSPORTS)
        ttfts["pd"] = ttft(cluster, model, cfg.ttft_tokens, "disaggregated", cfg.repeats)
        ttfts["colo"] = ttft(cluster, model, cfg.ttft_tokens, "colocated", cfg.repeats)
        console.print(f"TTFT at {cfg.ttft_tokens} tokens: P/D {ttfts['pd']:.0f} ms, colocated {ttfts['colo']:.0f} ms")
        # The router's layer-wise pairs against sequential ones, at the largest size (where a whole pull
        # costs most); through two routers over the same nodes.
        ab = ttft_layerwise_vs_sequential(cluster, model, max(cfg.sizes), cfg.repeats, cfg.router_port + 1)
        ttfts.update(ab)
        console.print(f"TTFT at {max(cfg.sizes)} tokens through the router: {json.dumps(ab)}")
        block_nbytes = int(block_nbytes_of(samples))
    if cfg.nixl:
        for label, env in (("nixl", {}), ("nixl_tcp", {"UCX_TLS": "tcp"})):
            cluster = _cluster(cfg, workdir / label, "nixl", both=0)
            with environment(env), _started(cluster, label) as model:
                samples += measure_transfers(cluster, model, cfg, nixl=True, label=label, transports=(None,))
    result = summarise(samples, cfg, ttfts, block_nbytes, fixed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    png = out.with_suffix(".png")
    plot(result, png)
    console.print(f"wrote {out} and {png}")
    return result


def run_device_bench(device: str, out: Path) -> dict[str, Any]:
    """``--standalone``: the device check without engines (``infra/device/kv_cuda_bench.py``)."""
    from infra.device.kv_cuda_bench import main

    out.parent.mkdir(parents=True, exist_ok=True)
    return main(["--device", device, "--out", str(out)])
