"""The router's CPU per streamed request at an engine's pace, without an engine: one router process
over paced STAND-IN engines (``bench.standin_engine``: ``--token-interval-ms``), the per-request figure
``tandem bench overhead`` reports for its Tandem arm, in a minute and with no engine to start.

    python -m bench.relay_cpu --interval-ms 30 300 --rounds 3

For each pace: rounds of ``streams`` concurrent chat streams of ``tokens`` tokens (with the usage chunk,
as ``vllm bench serve`` asks), the router's CPU over each round (every thread, from the scheduler's
counters) divided by its requests; before them, its idle CPU per second. A round at a CPU engine's pace
(30-300 ms per token) is one wake-up per chunk; the idle share grows with the round's length."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from bench.procs import sched_cpu_s, stop_all
from bench.router_ceiling import _async_redis, _count_chunks, _standin, _standin_node, _start_router
from bench.standin_engine import free_port
from contracts.config import redis_url as configured_redis_url
from contracts.registry import NodeInfo, NodeRegistry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval-ms", type=float, nargs="+", default=[30.0, 300.0], help="paces, ms per token")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--redis-url", default=configured_redis_url(db=11))
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="tandem-relay-cpu-"))
    procs: list[subprocess.Popen[bytes]] = []
    nodes: list[tuple[float, NodeInfo]] = []
    try:
        for pace in args.interval_ms:
            port = free_port()
            procs.append(
                _standin(
                    port,
                    workdir / "standin.log",
                    *("--stream-tokens", str(args.tokens), "--token-interval-ms", str(pace)),
                )
            )
            model = f"relay-cpu-{pace:g}-{uuid.uuid4().hex[:6]}"
            info = _standin_node(model, port)
            nodes.append((pace, info))  # before registering: a registration that fails half-way is removed too
            asyncio.run(NodeRegistry(_async_redis(args.redis_url), ttl_s=3600).register(info))
        port = free_port()
        config = argparse.Namespace(workdir=workdir, redis_url=args.redis_url)  # what _start_router reads
        router = _start_router(config, port, set(os.sched_getaffinity(0)), workdir)  # type: ignore[arg-type]
        procs.append(router)
        url = f"http://127.0.0.1:{port}"
        for _, info in nodes:
            asyncio.run(
                _count_chunks(url, info.model, 4, 8, include_usage=True)
            )  # warm: tokenizer, pool, first-use paths
        cpu0, t0 = sched_cpu_s(router.pid), time.monotonic()
        time.sleep(args.idle_s)  # the idle window itself: nothing to wait for
        idle = (sched_cpu_s(router.pid) - cpu0) / (time.monotonic() - t0)
        print(f"router idle: {idle * 1000:.2f} ms of CPU per second", flush=True)
        for pace, info in nodes:
            per: list[float] = []
            for _ in range(args.rounds):
                cpu0 = sched_cpu_s(router.pid)
                asyncio.run(_count_chunks(url, info.model, args.streams, args.tokens, include_usage=True))
                per.append((sched_cpu_s(router.pid) - cpu0) * 1000 / args.streams)
            print(
                f"{pace:g} ms per token: router CPU {sum(per) / len(per):.2f} ms per request "
                f"(rounds {', '.join(f'{p:.2f}' for p in per)})",
                flush=True,
            )
    finally:
        stop_all(procs)
        for _, info in nodes:
            asyncio.run(NodeRegistry(_async_redis(args.redis_url), ttl_s=3600).deregister(info.node_id))


if __name__ == "__main__":
    main()
