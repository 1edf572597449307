"""TTFT with telemetry on vs off, same engine, same run.

Two routers over one colocated node: the cluster's own router with telemetry on, the cluster's lake
writer behind it (as ``tandem up`` runs them), and a second router started with the same arguments and
environment except ``TANDEM_ROUTER_TELEMETRY=false`` (its own SQLite file, as each router has).

What keeps the comparison fair:
- one discarded warm-up round per router first: the router's tokenizer and connections, and the
  engine's prefix cache holding the bench prompts, whichever router measures first (without it the
  first "on" round alone paid the cold prefill);
- every measured round is mixed: ``concurrency`` streams start together, half through each router,
  alternating in launch order, each adjacent pair sending the same prompt (which of the two goes
  first flips every round). At concurrency 32 a request's TTFT is mostly its place in the engine's
  queue, and that place, like the round's conditions (the engine's batching, the shared machine),
  is shared by both modes instead of being drawn separately per round: rounds of one mode alone
  differed by up to 40% from one another here, drowning a 2% effect;
- both routers and the bench share one priority and affinity (inherited); the writer runs at idle
  CPU priority, as the launcher always starts it (telemetry.priority).

What keeps it honest: after the rounds, every request the "on" router finished must be a row of the
lake, written by the writer (counted by ``source``), and its emitter must have dropped nothing; the
result carries these counts, the rows already written when the last round ended, and the writer's CPU
time and scheduling policy during the rounds.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import RequestResult, one_request, percentile, run_level, streamed_chat
from bench.pd import bench_prompts
from bench.procs import router_command, wait_http
from contracts.errors import ConfigError
from infra.launcher import Cluster, ClusterSpec
from telemetry.query import query

_POLICY_NAMES = {0: "SCHED_OTHER", 3: "SCHED_BATCH", 5: "SCHED_IDLE"}


def _start_off_router(cluster: Cluster, port: int) -> subprocess.Popen[bytes]:
    """A router configured like the cluster's (launcher.Cluster.start), telemetry off."""
    spec = cluster.spec
    env = {
        **os.environ,
        "TANDEM_SQLITE_PATH": str(spec.workdir / "tandem-telemetry-off.db"),
        **dict(spec.router_env),
        "TANDEM_ROUTER_TELEMETRY": "false",
    }
    cmd = router_command(port, cluster.redis_url)
    if spec.policy is not None:
        cmd += ["--policy", spec.policy]
    log = (cluster.logs / "router-telemetry-off.log").open("ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _metric_sum(url: str, name: str) -> float:
    """Sum of every sample of one Prometheus counter on ``url``/metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$")
    return sum(float(m.group(1)) for line in text.splitlines() if (m := pattern.match(line)))


def _lake_rows(lake: Path, source: str, since: float) -> int:
    """Request rows ``source`` emitted since ``since`` (epoch s): this run's, whatever an earlier run
    left in Redis."""
    if not (lake / "requests").is_dir():
        return 0
    sql = f"SELECT count(*) AS n FROM requests WHERE source = '{source}' AND event_time >= to_timestamp({since})"
    return int(query(lake, sql).to_pylist()[0]["n"])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (proc(5))."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _policy(pid: int) -> str:
    policy = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[38])
    return _POLICY_NAMES.get(policy, str(policy))


def _round(url: str, model: str, prompts: list[Any], concurrency: int, max_tokens: int) -> list[float]:
    _, results = asyncio.run(run_level(url, model, prompts, concurrency, concurrency, max_tokens))
    _check(results)
    return [r.ttft_s for r in results]


def _check(results: list[RequestResult]) -> None:
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise ConfigError(f"{len(failed)} of {len(results)} requests failed, e.g. {failed[0]}")


def _mixed_round(
    urls: dict[str, str], model: str, prompts: list[Any], concurrency: int, max_tokens: int, on_first: bool
) -> dict[str, list[float]]:
    """``concurrency`` streams at once: stream ``j`` sends prompt ``j // 2`` through the "on" router
    when ``j`` is even (odd when ``on_first`` is False), else through the "off" one."""
    order = ("on", "off") if on_first else ("off", "on")
    plan = [(order[j % 2], prompts[(j // 2) % len(prompts)]) for j in range(concurrency)]

    async def run() -> list[RequestResult]:
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
            return await asyncio.gather(
                *(
                    one_request(
                        client,
                        f"{urls[mode]}/v1/chat/completions",
                        streamed_chat(model, messages, max_tokens),
                        {},
                    )
                    for mode, messages in plan
                )
            )

    results = asyncio.run(run())
    _check(results)
    out: dict[str, list[float]] = {"on": [], "off": []}
    for (mode, _), r in zip(plan, results, strict=True):
        out[mode].append(r.ttft_s)
    return out


def _wait_lake(lake: Path, source: str, since: float, want: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    rows = _lake_rows(lake, source, since)
    while rows < want and time.monotonic() < deadline:
        time.sleep(1.0)  # the writer commits parts on its own schedule
        rows = _lake_rows(lake, source, since)
    return rows


def run_ttft_on_off(
    redis_url: str,
    *,
    concurrency: int = 32,
    rounds: int = 12,
    max_tokens: int = 16,
    router_port: int = 18700,
    node_base_port: int = 18800,
    drain_timeout_s: float = 120.0,
) -> dict[str, Any]:
    """``rounds`` measured rounds per mode of ``concurrency`` simultaneous streamed requests."""
    workdir = Path(".tandem") / "bench-telemetry"
    spec = ClusterSpec(
        prefill=0,
        decode=0,
        both=1,
        router_port=router_port,
        node_base_port=node_base_port,
        redis_url=redis_url,
        workdir=workdir,
        router_env=(("TANDEM_ROUTER_TELEMETRY", "true"),),
    )
    off_port = router_port + 1
    source = f"router-{router_port}"
    ttft: dict[str, list[float]] = {"on": [], "off": []}
    round_p50: dict[str, list[float]] = {"on": [], "off": []}
    sequence: list[str] = []
    shutil.rmtree(workdir / "lake", ignore_errors=True)  # this benchmark's own lake
    since = time.time()
    with Cluster(spec) as cluster:
        writer_pid = next(p.pid for name, p in cluster.procs if name == "lake-writer")
        off = _start_off_router(cluster, off_port)
        try:
            urls = {"on": cluster.url, "off": f"http://127.0.0.1:{off_port}"}
            wait_http(f"{urls['off']}/health", lambda: off.poll() is None, 120)
            model = httpx.get(f"{cluster.url}/v1/models").json()["data"][0]["id"]
            prompts = bench_prompts()
            for mode in ("on", "off"):  # warm-up, discarded
                _round(urls[mode], model, prompts, concurrency, max_tokens)
            writer_cpu0 = _cpu_s(writer_pid)
            writer_policy = _policy(writer_pid)
            for i in range(rounds):
                mixed = _mixed_round(urls, model, prompts, concurrency, max_tokens, on_first=i % 2 == 0)
                for mode, values in mixed.items():
                    ttft[mode] += values
                    round_p50[mode].append(percentile(values, 0.5) * 1000)
                sequence.append("on-first" if i % 2 == 0 else "off-first")
            writer_cpu = _cpu_s(writer_pid) - writer_cpu0
            rows_at_end = _lake_rows(cluster.lake, source, since)
            on_requests = int(_metric_sum(cluster.url, "tandem_requests_total"))
            rows = _wait_lake(cluster.lake, source, since, on_requests, drain_timeout_s)
            dropped = int(_metric_sum(cluster.url, "tandem_telemetry_dropped_events_total"))
        finally:
            os.killpg(off.pid, signal.SIGTERM)
            off.wait(30)
    telemetry = {
        "on_router_requests": on_requests,
        "lake_request_rows": rows,
        "lake_rows_when_rounds_ended": rows_at_end,
        "every_request_in_lake": rows == on_requests,
        "dropped_events": dropped,
        "writer_cpu_s_during_rounds": round(writer_cpu, 2),
        "writer_scheduling_policy": writer_policy,
    }
    return _summary(ttft, round_p50, sequence, concurrency, rounds, telemetry)


def _summary(
    ttft: dict[str, list[float]],
    round_p50: dict[str, list[float]],
    sequence: list[str],
    concurrency: int,
    rounds: int,
    telemetry: dict[str, Any],
) -> dict[str, Any]:
    on_ms, off_ms = percentile(ttft["on"], 0.5) * 1000, percentile(ttft["off"], 0.5) * 1000
    # Each round holds both modes, side by side.
    pairs = [100 * (round_p50["on"][i] - round_p50["off"][i]) / round_p50["off"][i] for i in range(rounds)]
    return {
        "design": "mixed rounds: concurrency streams at once, half per router, alternating in launch order, "
        "adjacent pairs with the same prompt",
        "concurrency": concurrency,
        "rounds": rounds,
        "order": sequence,
        "warm_up_rounds_per_router": 1,
        "requests_per_mode": len(ttft["on"]),
        "ttft_on_ms": round(on_ms, 1),
        "ttft_off_ms": round(off_ms, 1),
        "overhead_pct": round(100 * (on_ms - off_ms) / off_ms, 2),
        "round_p50_ms": {m: [round(v, 1) for v in vs] for m, vs in round_p50.items()},
        "pair_overhead_pct": [round(p, 2) for p in pairs],
        "pair_overhead_pct_median": round(statistics.median(pairs), 2),
        "telemetry": telemetry,
    }
