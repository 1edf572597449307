"""The benchmarks of what surrounds the serving path: telemetry's cost and the lake writer's throughput
(``telemetry``), the admission fast path (``admission``), faults fired into a running cluster (``chaos``)
and into one spread over the hosts of a lab (``hosts``), and the simulator checked against real clusters (``sim``).

Each command only turns its options into the benchmark's config, runs it under ``clean_errors`` and prints
its ``RESULT`` line; the benchmark module (imported inside the command, so ``tandem --help`` stays fast)
starts and stops what it measures. ``bench.cli`` registers the commands, in the order ``--help`` lists them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import typer

from bench.commands.options import Out, RedisUrl
from contracts.cli import clean_errors, console
from contracts.config import redis_url as _redis_url


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


def _known_faults(faults: tuple[str, ...], known: Iterable[str]) -> None:
    """Exit 2 with the valid names when ``faults`` names one that ``known`` does not have."""
    known = list(known)
    unknown = [f for f in faults if f not in known]
    if unknown:
        console.print(f"[red]error:[/red] unknown fault {', '.join(unknown)}; choose from {', '.join(known)}")
        raise typer.Exit(2)


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
    _known_faults(faults, FAULTS)
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


def bench_hosts(
    out: Annotated[Path, typer.Option(help="JSON results; a PNG timeline is written beside it.")] = Path(
        "results/bench-hosts.json"
    ),
    streams: Annotated[int, typer.Option(help="Concurrent SSE clients (on the lab's client host).")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 32,
    settle_s: Annotated[float, typer.Option(help="Steady service before each fault.")] = 15.0,
    stop_s: Annotated[float, typer.Option(help="How long the SIGSTOP fault stops the engine.")] = 30.0,
    cut_s: Annotated[float, typer.Option(help="How long a cut host stays off the network.")] = 20.0,
    recovery_timeout_s: Annotated[float, typer.Option(help="A fault not recovered by then did not survive.")] = (240.0),
    fault: Annotated[
        list[str] | None,
        typer.Option(help="Faults to fire, in order (repeatable; default: all, see docs/bench/hosts.md)."),
    ] = None,
    net: Annotated[int, typer.Option(help="The lab's addresses are 10.<net>.0.0/24.")] = 233,
) -> None:
    """bench chaos's faults, partitions (decode, prefill, store host cut) and a whole host lost, on a lab of
    network namespaces (root only): one host per component, a workload from a client host. The same
    figures and RESULT fields as bench chaos. ~20 min on 2 cores."""
    from bench.chaos_report import result_line
    from bench.hosts import FAULT_NAMES, FAULTS, HostsConfig, run_hosts_bench

    faults = tuple(fault or FAULT_NAMES)
    _known_faults(faults, FAULTS)
    cfg = HostsConfig(
        streams=streams,
        max_tokens=max_tokens,
        settle_s=settle_s,
        stop_s=stop_s,
        cut_s=cut_s,
        recovery_timeout_s=recovery_timeout_s,
        faults=faults,
        net=net,
    )
    with clean_errors():
        summary = run_hosts_bench(out, cfg)
    print(result_line(summary), flush=True)


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
