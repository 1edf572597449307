"""The benchmarks that put Tandem beside what it replaces or wraps: disaggregated against colocated
(``pd``), Tandem against the plain vLLM it runs and vllm-router (``overhead``, ``routing``, ``fleet``), and
the agent APIs against the engines' own endpoints (``agents``).

Each command only turns its options into the benchmark's config, runs it under ``clean_errors`` and prints
its ``RESULT`` line; the benchmark module (imported inside the command, so ``tandem --help`` stays fast)
starts and stops what it measures. ``bench.cli`` registers the commands, in the order ``--help`` lists them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bench.commands.options import Out, RedisUrl
from contracts.cli import clean_errors, console
from contracts.config import redis_url as _redis_url


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
    tier_rounds: Annotated[
        int,
        typer.Option(
            min=0,
            help="Extra rounds of the two Tandem arms alone, after the main ones: their difference is smaller than "
            "a round's spread, so the defaults-against-tier check pools every round of the two.",
        ),
    ] = 4,
    concurrency: Annotated[int, typer.Option(min=1, help="Agent sessions in flight at once.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 24,
    host_tier: Annotated[str, typer.Option(help="Host tier size of the tandem_tier arm.")] = "2GiB",
    routers: Annotated[
        int | None, typer.Option(min=1, help="Router replicas of the Tandem arms (default: tandem up's).")
    ] = None,
    port_base: Annotated[
        int, typer.Option(help="First engine port (engine i: +10*i; routers +50, +51; Redis +60).")
    ] = 19700,
    redis_url: Annotated[
        str | None,
        typer.Option(help="Registry Redis of the Tandem arms (default: an embedded one per arm, port-base + 60)."),
    ] = None,
) -> None:
    """Tandem (defaults; with host tier + peer fetch) against vllm-router (cache_aware, round_robin) on N
    fresh engines per arm: multi-turn agent sessions with shared repository contexts and tool pauses.
    Per arm: hit, TTFT, client and engine ITL, E2E, sessions per minute, non-engine CPU; issue 37's
    targets printed as held or missed. ~20 min on 2 cores (~10 with --tier-rounds 0)."""
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
        tier_rounds=tier_rounds,
        concurrency=concurrency,
        max_tokens=max_tokens,
        host_tier=host_tier,
        routers=routers,
        port_base=port_base,
        redis_url=redis_url,
    )
    with clean_errors():
        result = run_fleet_bench(out, cfg)
    for name, t in result["targets"].items():
        print(f"{'held  ' if t['held'] else 'MISSED'} {name}: {t['value']} (bound {t['bound']})", flush=True)
    print(result_line(result), flush=True)


def bench_agents(
    out: Out = Path("results/bench-agents.json"),
    api: Annotated[
        list[str] | None,
        typer.Option(
            help="APIs (repeatable; default: chat, responses, messages, and the chained Responses sessions "
            "over SSE and over one WebSocket each: responses-chain, responses-ws)."
        ),
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
    Messages, against `tandem up` (1P+1D) and against the same engines' own endpoints, and the same
    chained Responses sessions over SSE and over one WebSocket each: TTFT, ITL, session completion
    time, hit rate, per-turn overhead (TTFT less the streaming engine's own TTFT) and errors
    per arm. ~8 min on 2 cores with the defaults."""
    from dataclasses import replace

    from bench.agent_apis import APIS
    from bench.agent_socket import CHAINED
    from bench.agents import TARGETS, AgentsBenchConfig, result_line, run_agents_bench

    apis, targets = tuple(api or (*APIS, *CHAINED)), tuple(target or TARGETS)
    for given, known, what in ((apis, (*APIS, *CHAINED), "api"), (targets, TARGETS, "target")):
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
