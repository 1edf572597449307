"""Where a router's CPU per request goes, arm against arm, under ``tandem bench overhead``'s own load.

    python -m bench.router_ab --arms tandem,peer --reps 2
    python -m bench.router_ab --arms "tandem,tandem:TANDEM_ROUTER_CPU_PRIORITY=normal" --reps 3

An arm is ``tandem`` or ``peer`` (``bench.overhead.serve_arm``: a fresh engine with the node's flags on
every core, behind the Tandem router or vllm-router), optionally with environment variables for the
processes it starts after a colon (``KEY=VALUE``, several joined by ``+``): two trees' or two settings'
routers measured in the same minutes of the same host. Reps alternate the arms' order. Each arm and rep
sends ``vllm bench serve``'s load (``OverheadBenchConfig``'s prompts and concurrency, no agent workload)
and reports, per request: the router's CPU over the load's window (the figure ``bench overhead``
reports), split by thread (the event loop's ``main`` against the rest: the telemetry flusher, other
helpers; over the client's whole run, its start-up's idle seconds included, so the threads' sum runs a
little above the window's figure); its voluntary context switches (wake-ups: a router that relays more
chunks per wake-up takes fewer) and involuntary ones (preemptions by the engine's threads); for Tandem,
the KV-event batches its subscriber applied (``/cluster``).

What these figures showed on a 2-core Xeon host (``docs/bench/overhead.md``): the router's CPU follows
its wake-ups (``SCHED_BATCH``, the default: 8.6 wake-ups and 3.4 ms per request; ``normal``: 37.6 and
4.1 ms; two runs each), the telemetry flusher's thread took 0.15-0.24 ms of it, the KV events were 0.36
batches per request. A JSON of every run is written to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.host import host_record
from bench.overhead import OverheadBenchConfig, serve_arm, vllm_bench_serve
from bench.procs import ThreadStat, environment, thread_stats

ROUTERS = ("tandem", "peer")


@dataclass(frozen=True)
class Arm:
    name: str
    """As given: ``tandem`` or ``peer``, then its environment after a colon."""
    router: str
    env: tuple[tuple[str, str], ...] = ()


def parse_arm(spec: str) -> Arm:
    router, _, envs = spec.partition(":")
    if router not in ROUTERS:
        raise ValueError(f"arm {spec!r}: the router is one of {', '.join(ROUTERS)}")
    env = []
    for item in filter(None, envs.split("+")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"arm {spec!r}: {item!r} is not KEY=VALUE")
        env.append((key, value))
    return Arm(spec, router, tuple(env))


def per_request(before: dict[int, ThreadStat], after: dict[int, ThreadStat], pid: int, requests: int) -> dict[str, Any]:
    """CPU ms by thread (``main``: the thread whose id is ``pid``; the others by name and id, largest
    first) and context switches, per request, between two snapshots of one process."""
    n = max(1, requests)
    cpu: dict[str, float] = {}
    voluntary = involuntary = 0
    for tid, now in after.items():
        then = before.get(tid, ThreadStat(now.name, 0, 0, 0))
        label = "main" if tid == pid else f"{now.name}-{tid}"
        cpu[label] = round((now.cpu_ns - then.cpu_ns) / 1e6 / n, 3)
        voluntary += now.voluntary - then.voluntary
        involuntary += now.involuntary - then.involuntary
    return {
        "threads_ms": dict(sorted(cpu.items(), key=lambda kv: -kv[1])),
        "wakeups": round(voluntary / n, 1),
        "preemptions": round(involuntary / n, 1),
    }


def _kv_batches(url: str) -> int | None:
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        nodes = httpx.get(f"{url}/cluster", timeout=5).json()["nodes"]
        return sum(int(n["kv_events"]["applied_batches"]) for n in nodes)
    return None


def run_arm(arm: Arm, cfg: OverheadBenchConfig, slot: int, seed: int) -> dict[str, Any]:
    with environment(dict(arm.env)), serve_arm(arm.router, cfg, slot) as served:
        pid = served.router_pids[0]
        kv0 = _kv_batches(served.url) if arm.router == "tandem" else None
        before = thread_stats(pid)
        res = vllm_bench_serve(served, cfg, seed, cfg.workdir / "router-ab")
        after = thread_stats(pid)
        kv1 = _kv_batches(served.url) if arm.router == "tandem" else None
    out = {"arm": arm.name, **res, **per_request(before, after, pid, res["completed"])}
    if kv0 is not None and kv1 is not None:
        out["kv_batches"] = round((kv1 - kv0) / max(1, res["completed"]), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="tandem,peer", help="comma-separated: tandem|peer[:KEY=VALUE[+KEY=VALUE]]")
    ap.add_argument("--reps", type=int, default=2, help="runs of every arm, order alternating")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("results/router-ab.json"))
    args = ap.parse_args()
    arms = [parse_arm(s) for s in args.arms.split(",") if s]
    cfg = OverheadBenchConfig(num_prompts=args.num_prompts, concurrency=args.concurrency, agent_sessions=0)
    load_before = os.getloadavg()
    tag = int(time.time()) % 100_000
    runs = []
    for rep in range(args.reps):
        order = arms if rep % 2 == 0 else arms[::-1]
        for slot, arm in enumerate(order):
            run = run_arm(arm, cfg, slot, tag * 100 + rep * 10 + slot)
            runs.append({"rep": rep, **run})
            busy = {thread: ms for thread, ms in run["threads_ms"].items() if ms >= 0.005}  # all of them: --out
            print(
                f"{arm.name} rep {rep}: router CPU {run['router_cpu_ms_per_req']} ms/req {busy}, "
                f"{run['wakeups']} wake-ups and {run['preemptions']} preemptions per request"
                + (f", {run['kv_batches']} KV batches" if "kv_batches" in run else "")
                + f"; {run['req_s']} req/s, TPOT p50 {run['tpot_p50_ms']} ms",
                flush=True,
            )
    medians = {a.name: statistics.median(r["router_cpu_ms_per_req"] for r in runs if r["arm"] == a.name) for a in arms}
    print("RESULT " + " ".join(f"{name}={ms:.2f}" for name, ms in medians.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "router-ab", "host": host_record(load_before), "runs": runs, "median_cpu_ms": medians}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
