"""``tandem bench ...``: the benchmarks, each starting and stopping what it measures, each ending with a
``RESULT`` line."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from contracts.cli import clean_errors, console, interrupt
from contracts.config import redis_url as _redis_url

Out = Annotated[Path, typer.Option(help="JSON results; a PNG plot is written beside it.")]
RedisUrl = Annotated[
    str | None,
    typer.Option(
        help="Registry Redis for the benchmark's clusters (default: $TANDEM_REDIS_URL, a database of its own)."
    ),
]

bench_app = typer.Typer(
    help="Benchmarks (write JSON results, render plots, print a RESULT line).", no_args_is_help=True
)


@bench_app.callback()
def _bench_signals() -> None:
    """SIGTERM unwinds every benchmark like Ctrl-C, so the clusters and processes it started are stopped
    by the code that started them (a shell's background job ignores SIGINT, so a script can only stop
    it with SIGTERM). Their parent-death signal covers a benchmark killed outright."""
    signal.signal(signal.SIGTERM, interrupt)


@bench_app.command("pd")
def bench_pd(
    out: Out = Path("results/bench-pd.json"),
    concurrency: Annotated[list[int] | None, typer.Option(help="Concurrency levels (repeatable).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 64,
    requests: Annotated[int, typer.Option(help="Requests per level (0: max(8, 2 x concurrency)).")] = 0,
    redis_url: RedisUrl = None,
) -> None:
    """Disaggregated (1P+1D) vs colocated (1 node): TTFT, ITL, E2E p50/p99 and output tokens/s at
    concurrency 1, 8 and 32. Starts and stops its own clusters."""
    redis_url = redis_url or _redis_url(db=9)
    from bench.pd import PdBenchConfig, run_pd_bench

    cfg = PdBenchConfig(
        concurrencies=tuple(concurrency or (1, 8, 32)),
        max_tokens=max_tokens,
        requests_per_level=requests,
        redis_url=redis_url,
    )
    with clean_errors():
        s = run_pd_bench(out, cfg)
    print(
        f"RESULT pd_ttft_p50_ms={s['pd_ttft_p50_ms']} colo_ttft_p50_ms={s['colo_ttft_p50_ms']} "
        f"pd_tok_s={s['pd_tok_s']} colo_tok_s={s['colo_tok_s']}",
        flush=True,
    )


@bench_app.command("overhead")
def bench_overhead(
    out: Out = Path("results/bench-overhead.json"),
    rounds: Annotated[int, typer.Option(help="Rounds; each runs every arm on a fresh engine, order alternating.")] = 2,
    num_prompts: Annotated[int, typer.Option(help="vllm bench serve: prompts per arm and round.")] = 64,
    concurrency: Annotated[int, typer.Option(help="vllm bench serve: --max-concurrency.")] = 16,
    input_len: Annotated[int, typer.Option(help="vllm bench serve: random prompt length, tokens.")] = 512,
    output_len: Annotated[int, typer.Option(help="vllm bench serve: output tokens (--ignore-eos).")] = 64,
    agent_sessions: Annotated[int, typer.Option(help="Agent-workload sessions per arm and round (0: skip).")] = 4,
    ceiling_streams: Annotated[int, typer.Option(help="Router ceiling: concurrent streams.")] = 64,
    redis_url: Annotated[
        str | None,
        typer.Option(
            help="Registry Redis for the Tandem arms (a database of their own)"
            " (default: $TANDEM_REDIS_URL, database 11)."
        ),
    ] = None,
    routers: Annotated[
        int,
        typer.Option(
            help="Router replicas of the Tandem arm: 1 (default) against the peer's one vllm-router;"
            " 2 as `tandem up` runs them, for availability."
        ),
    ] = 1,
) -> None:
    """What Tandem costs over the vLLM it wraps, same cores, one run: plain `vllm serve` (node's flags),
    vllm-router in front of it, a Tandem node straight to its engine, and Tandem through its router;
    load from `vllm bench serve` and the agent workload; then the router's SSE chunks/s on one core
    over a stand-in engine. ~15 min on 2 cores."""
    redis_url = redis_url or _redis_url(db=6)
    from bench.overhead import OverheadBenchConfig, run_overhead_bench
    from bench.overhead_report import result_line

    cfg = OverheadBenchConfig(
        rounds=rounds,
        num_prompts=num_prompts,
        concurrency=concurrency,
        input_len=input_len,
        output_len=output_len,
        agent_sessions=agent_sessions,
        ceiling_streams=ceiling_streams,
        redis_url=redis_url,
        routers=routers,
    )
    with clean_errors():
        result = run_overhead_bench(out, cfg)
    print(result_line(result), flush=True)


@bench_app.command("kv-transfer")
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


@bench_app.command("routing")
def bench_routing(
    out: Out = Path("results/bench-routing.json"),
    repos: Annotated[int, typer.Option(help="Repositories (each context shared by its sessions).")] = 2,
    sessions_per_repo: Annotated[int, typer.Option(help="Agent sessions per repository.")] = 3,
    turns_min: Annotated[int, typer.Option(help="Fewest turns of a session.")] = 6,
    turns_max: Annotated[int, typer.Option(help="Most turns of a session.")] = 10,
    repo_tokens: Annotated[int, typer.Option(help="Tokens of each repository's context.")] = 800,
    tool_tokens: Annotated[int, typer.Option(help="Largest tool output of a turn, tokens (smallest: a third).")] = (
        100
    ),
    session_gap_s: Annotated[float, typer.Option(help="Mean gap between session arrivals (open loop).")] = 5.0,
    think_s: Annotated[float, typer.Option(help="Mean pause between an answer and the next turn.")] = 1.0,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 16,
    seed: Annotated[int, typer.Option(help="Workload seed (same seed, same request sequence).")] = 7,
    policy: Annotated[
        list[str] | None,
        typer.Option(help="Tandem policies of part 2 (repeatable; default cache_aware, least_loaded, round_robin)."),
    ] = None,
    pd: Annotated[bool, typer.Option(help="Part 2: the policies on 2 prefill + 1 decode nodes.")] = True,
    peer: Annotated[bool, typer.Option(help="Part 3: Tandem vs vllm-router on 2 colocated nodes.")] = True,
    kv_cache_gib: Annotated[int, typer.Option(help="KV cache per node, GiB (1 GiB: ~23k tokens in float32).")] = 1,
    dtype: Annotated[str, typer.Option(help="Engine dtype (float32 prefills ~2x faster than bfloat16 on AVX2).")] = (
        "float32"
    ),
    block_size: Annotated[int, typer.Option(help="KV block size of every node (multiple of 32 on CPU).")] = 32,
    router_port: Annotated[int, typer.Option(help="First router port (routers use +0..+4, vllm-router +50).")] = (
        19000
    ),
    node_base_port: Annotated[int, typer.Option(help="First node port; node i uses base+10*i.")] = 19100,
    redis_url: RedisUrl = None,
) -> None:
    """Cache-aware routing on a synthetic coding-agent workload: engine-confirmed hit rate, TTFT p50/p99
    and prefill tokens per policy on 2 prefill + 1 decode nodes, against an unlimited cache (ideal_hit);
    then Tandem vs vllm-router (cache_aware, kv_aware) on 2 colocated nodes. ~15-20 min on 2 cores."""
    redis_url = redis_url or _redis_url(db=10)
    from bench.agent_workload import AgentWorkloadConfig
    from bench.routing import TANDEM_POLICIES, RoutingBenchConfig, run_routing_bench
    from router.policies import PolicyName

    policies = tuple(policy or TANDEM_POLICIES)
    unknown = [p for p in policies if p not in {n.value for n in PolicyName}]
    if unknown:
        console.print(f"[red]error:[/red] unknown policy {', '.join(unknown)}; choose from {', '.join(PolicyName)}")
        raise typer.Exit(2)
    workload = AgentWorkloadConfig(
        repos=repos,
        sessions_per_repo=sessions_per_repo,
        turns_min=turns_min,
        turns_max=turns_max,
        repo_tokens=repo_tokens,
        tool_tokens=(max(1, tool_tokens // 3), tool_tokens),
        session_gap_s=session_gap_s,
        think_s=think_s,
        seed=seed,
    )
    cfg = RoutingBenchConfig(
        workload=workload,
        policies=policies,
        pd=pd,
        peer=peer,
        max_tokens=max_tokens,
        router_port=router_port,
        node_base_port=node_base_port,
        redis_url=redis_url,
        kv_cache_gib=kv_cache_gib,
        dtype=dtype,
        block_size=block_size,
    )
    # SIGTERM unwinds like Ctrl-C, so the benchmark's clusters are stopped (a shell's background job
    # ignores SIGINT, so a script can only stop it with SIGTERM).
    with clean_errors():
        s = run_routing_bench(out, cfg)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in s.items()), flush=True)


@bench_app.command("fleet")
def bench_fleet(
    out: Out = Path("results/bench-fleet.json"),
    nodes: Annotated[int, typer.Option(min=1, help="Colocated nodes (engines) of every arm.")] = 2,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; each alternates the arm order, new content.")] = 2,
    arm: Annotated[
        list[str] | None,
        typer.Option(
            help="Arms (repeatable; default: tandem, tandem_tier, vllm_router_cache_aware, vllm_router_round_robin)."
        ),
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Agent sessions in flight at once.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 24,
    host_tier: Annotated[str, typer.Option(help="Host tier size of the tandem_tier arm.")] = "2GiB",
    routers: Annotated[
        int | None, typer.Option(min=1, help="Router replicas of the Tandem arms (default: tandem up's).")
    ] = None,
    port_base: Annotated[int, typer.Option(help="First engine port (engine i: +10*i; routers +50, +51).")] = 19700,
    redis_url: Annotated[
        str | None,
        typer.Option(help="Registry Redis of the Tandem arms (default: $TANDEM_REDIS_URL, database 12)."),
    ] = None,
) -> None:
    """Tandem (defaults; with host tier + peer fetch) against vllm-router (cache_aware, round_robin) on N
    fresh engines per arm: multi-turn agent sessions with shared repository contexts and tool pauses.
    Per arm: hit, TTFT, client and engine ITL, E2E, sessions per minute, non-engine CPU; issue 37's
    targets printed as held or missed. ~20 min on 2 cores."""
    from bench.fleet import ARMS, FleetBenchConfig, result_line, run_fleet_bench

    arms = tuple(arm or ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        console.print(f"[red]error:[/red] unknown arm {', '.join(unknown)}; choose from {', '.join(ARMS)}")
        raise typer.Exit(2)
    cfg = FleetBenchConfig(
        nodes=nodes,
        rounds=rounds,
        arms=arms,
        concurrency=concurrency,
        max_tokens=max_tokens,
        host_tier=host_tier,
        routers=routers,
        port_base=port_base,
        redis_url=redis_url or _redis_url(db=12),
    )
    with clean_errors():
        result = run_fleet_bench(out, cfg)
    for name, t in result["targets"].items():
        print(f"{'held  ' if t['held'] else 'MISSED'} {name}: {t['value']} (bound {t['bound']})", flush=True)
    print(result_line(result), flush=True)


@bench_app.command("agents")
def bench_agents(
    out: Out = Path("results/bench-agents.json"),
    api: Annotated[
        list[str] | None, typer.Option(help="APIs (repeatable; default: chat, responses, messages).")
    ] = None,
    target: Annotated[list[str] | None, typer.Option(help="Targets (repeatable; default: tandem, engine).")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; each runs every arm once, order alternating.")] = 1,
    sessions_per_repo: Annotated[int, typer.Option(min=1, help="Agent sessions per repository (2 repositories).")] = 2,
    turns: Annotated[int, typer.Option(min=1, help="Turns of every session.")] = 4,
    system_tokens: Annotated[int, typer.Option(help="Tokens of the system prompt every session shares.")] = 1500,
    concurrency: Annotated[int, typer.Option(min=1, help="Agent sessions in flight at once.")] = 4,
    max_tokens: Annotated[int, typer.Option(min=1, help="Output tokens per request, at most.")] = 16,
    port_base: Annotated[int, typer.Option(help="First node port (node i: +10*i; the router +50).")] = 23200,
    redis_url: Annotated[
        str | None,
        typer.Option(help="Registry Redis of the cluster (default: $TANDEM_REDIS_URL, database 13)."),
    ] = None,
) -> None:
    """Coding-agent sessions shaped like Codex CLI's and Claude Code's (long system prompt and tool list,
    growing history, tool calls and results, tool pauses) through Chat Completions, Responses and
    Messages, against `tandem up` (1P+1D) and against the same engines' own endpoints: TTFT, ITL,
    session completion time, hit rate and errors per API. ~5 min on 2 cores with the defaults."""
    from dataclasses import replace

    from bench.agent_apis import APIS
    from bench.agents import TARGETS, AgentsBenchConfig, result_line, run_agents_bench

    apis, targets = tuple(api or APIS), tuple(target or TARGETS)
    for given, known, what in ((apis, APIS, "api"), (targets, TARGETS, "target")):
        unknown = [x for x in given if x not in known]
        if unknown:
            raise typer.BadParameter(f"unknown {what} {', '.join(unknown)}: choose from {', '.join(known)}")
    base = AgentsBenchConfig()
    workload = replace(
        base.workload,
        sessions_per_repo=sessions_per_repo,
        turns_min=turns,
        turns_max=turns,
        system_tokens=system_tokens,
    )
    cfg = replace(
        base,
        apis=apis,
        targets=targets,
        rounds=rounds,
        workload=workload,
        concurrency=concurrency,
        max_tokens=max_tokens,
        port_base=port_base,
        redis_url=redis_url or _redis_url(db=13),
    )
    with clean_errors():
        result = run_agents_bench(out, cfg)
    print(result_line(result), flush=True)


@bench_app.command("kv-cache")
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


@bench_app.command("telemetry")
def bench_telemetry(
    out: Annotated[Path, typer.Option(help="JSON results.")] = Path("results/bench-telemetry.json"),
    events: Annotated[int, typer.Option(help="Request events pre-filled for the lake-writer run.")] = 200_000,
    concurrency: Annotated[int, typer.Option(help="Concurrency of the TTFT on/off comparison.")] = 32,
    rounds: Annotated[
        int,
        typer.Option(
            help="Measured rounds; each sends `concurrency` streams at once, half "
            "through the router with telemetry, half through the one without."
        ),
    ] = 12,
    redis_url: Annotated[
        str | None,
        typer.Option(help="Redis for streams and the benchmark's registry (default: $TANDEM_REDIS_URL, database 9)."),
    ] = None,
) -> None:
    """(a) lake-writer throughput in request events/s from a pre-filled stream; (b) router TTFT p50
    with telemetry on vs off at the given concurrency, same node, both routers in every round."""
    redis_url = redis_url or _redis_url(db=9)
    import json

    from bench.telemetry import run_events_throughput
    from bench.telemetry_ttft import run_ttft_on_off

    with clean_errors():
        with console.status("lake writer: draining a pre-filled stream…"):
            writer = run_events_throughput(redis_url, events)
        console.print(f"lake writer: {writer['events_per_s']} events/s")
        with console.status("TTFT with telemetry on vs off…"):
            ttft = run_ttft_on_off(redis_url, concurrency=concurrency, rounds=rounds)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "telemetry", "lake_writer": writer, "ttft": ttft}, indent=2))
    print(
        f"RESULT events_per_s={writer['events_per_s']} ttft_on_ms={ttft['ttft_on_ms']} "
        f"ttft_off_ms={ttft['ttft_off_ms']}",
        flush=True,
    )


@bench_app.command("admission")
def bench_admission(
    out: Out = Path("results/bench-admission.json"),
    n: Annotated[int, typer.Option("-n", help="Fast-path samples (after 200 warm-up).")] = 5000,
    concurrency: Annotated[list[int] | None, typer.Option(help="Router concurrency levels (repeatable).")] = None,
    requests: Annotated[int, typer.Option(help="Timed router requests per level.")] = 1500,
    redis_url: Annotated[
        str | None,
        typer.Option(
            help="Redis for the run's keys, sessions, registry and telemetry "
            "(everything it writes is removed at the end; default: "
            "$TANDEM_REDIS_URL, database 7)."
        ),
    ] = None,
) -> None:
    """(a) Admission fast path in-process against the real Redis: auth + rate limits + session read
    (+ a free node slot), p50/p99 in µs per request, target p99 < 2 ms; (b) requests/s through the
    real router process over a no-op STAND-IN engine (labelled as such in the output), at concurrency
    1, 8 and 32. Starts and stops its own router and stand-in; needs no vLLM engine."""
    redis_url = redis_url or _redis_url(db=7)
    from bench.admission import AdmissionBenchConfig, result_line, run_admission_bench

    cfg = AdmissionBenchConfig(
        redis_url=redis_url, n=n, concurrencies=tuple(concurrency or (1, 8, 32)), requests_per_level=requests
    )
    with clean_errors():
        result = run_admission_bench(out, cfg)
    print(result_line(result), flush=True)


@bench_app.command("chaos")
def bench_chaos(
    out: Annotated[Path, typer.Option(help="JSON results; a PNG timeline is written beside it.")] = Path(
        "results/bench-chaos.json"
    ),
    streams: Annotated[int, typer.Option(help="Concurrent SSE clients.")] = 16,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 32,
    settle_s: Annotated[float, typer.Option(help="Steady service before each fault.")] = 20.0,
    stop_s: Annotated[float, typer.Option(help="How long the SIGSTOP fault stops the engine.")] = 30.0,
    recovery_timeout_s: Annotated[float, typer.Option(help="A fault not recovered by then did not survive.")] = (240.0),
    fault: Annotated[
        list[str] | None,
        typer.Option(
            help="Faults to fire, in order (repeatable; default all: "
            "sigkill_decode_engine, sigkill_prefill_engine, "
            "sigkill_node_agent, sigstop_engine, sigkill_router, "
            "sigkill_lake_writer, restart_redis)."
        ),
    ] = None,
    router_port: Annotated[int, typer.Option(help="Router port.")] = 19600,
    node_base_port: Annotated[int, typer.Option(help="First node port; node i uses base+10*i.")] = 19610,
    redis_port: Annotated[int, typer.Option(help="Port of the benchmark's own Redis (it restarts it).")] = 19695,
) -> None:
    """A steady agent workload (SSE streams) on 1P + 1D + 1 colocated node while each fault fires once:
    engines and a node agent killed, an engine stopped for 30 s, the router, the lake writer and Redis
    killed or restarted. Per fault: failed requests, recovery time; overall hung streams, stranded KV
    blocks, lost lake rows. ~15 min on 2 cores."""
    from bench.chaos import FAULTS, ChaosConfig, run_chaos_bench
    from bench.chaos_report import result_line

    faults = tuple(fault or FAULTS)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        console.print(f"[red]error:[/red] unknown fault {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
        raise typer.Exit(2)
    cfg = ChaosConfig(
        streams=streams,
        max_tokens=max_tokens,
        settle_s=settle_s,
        stop_s=stop_s,
        recovery_timeout_s=recovery_timeout_s,
        faults=faults,
        router_port=router_port,
        node_base_port=node_base_port,
        redis_port=redis_port,
    )
    with clean_errors():
        summary = run_chaos_bench(out, cfg)
    print(result_line(summary), flush=True)


@bench_app.command("sim")
def bench_sim(
    out: Annotated[Path, typer.Option(help="JSON results; a PNG and a folder of raw files are written beside it.")] = (
        Path("results/bench-sim.json")
    ),
    sessions: Annotated[int | None, typer.Option(help="Agent sessions in the synthetic trace (default: 45).")] = None,
    session_rate: Annotated[float, typer.Option(help="Session arrivals per second.")] = 0.5,
    seed: Annotated[
        int | None, typer.Option(help="Trace seed (default: from the clock, so no earlier run's cache can hit).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="Engine dtype (float32 prefills ~2x faster than bfloat16 on AVX2).")] = (
        "float32"
    ),
    block_size: Annotated[int, typer.Option(help="KV block size of every node (multiple of 32 on CPU).")] = 32,
    kv_cache_gib: Annotated[int, typer.Option(help="KV cache per node, GiB.")] = 1,
    router_port: Annotated[int, typer.Option(help="Router port of the benchmark's clusters.")] = 19700,
    node_base_port: Annotated[int, typer.Option(help="First node port; node i uses base+10*i.")] = 19710,
    from_json: Annotated[
        Path | None,
        typer.Option(
            help="Simulate a recorded run again (its trace, nodes, profiles and real figures) without engines, "
            "and write the comparison to --out: for work on the simulator."
        ),
    ] = None,
    redis_url: RedisUrl = None,
) -> None:
    """The simulator against the real cluster, same trace: 1P+1D and two colocated nodes, each behind a
    router, each started fresh, profiled where it stands (a step model per node kind, the router's
    overhead, the P/D handover), replayed closed loop, stopped; then the SIMULATED run of the same trace
    on the same nodes with that profile. Errors per metric (TTFT p50/p90, ITL p50, throughput relative;
    hit rate absolute) and whether the simulator ranks the two as they measured. 30-40 min on 2 cores."""
    from bench.sim import SimBenchConfig, resimulate, run_sim_bench

    def say(message: str) -> None:
        console.print(message, highlight=False)

    with clean_errors():
        if from_json is not None:
            doc = resimulate(from_json, out, say)
        else:
            cfg = SimBenchConfig(
                **({"sessions": sessions} if sessions is not None else {}),  # the one default: the config's
                seed=seed,
                session_rate=session_rate,
                dtype=dtype,
                block_size=block_size,
                kv_cache_gib=kv_cache_gib,
                router_port=router_port,
                node_base_port=node_base_port,
                redis_url=redis_url or _redis_url(db=8),
            )
            doc = run_sim_bench(out, cfg, say)
    print(doc["result"], flush=True)
