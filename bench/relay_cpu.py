"""The router's CPU per streamed request at an engine's pace, without an engine: one Tandem router process
over paced STAND-IN engines (``bench.standin_engine``: ``--token-interval-ms``), the per-request figure
``tandem bench overhead`` reports for its Tandem arm, in a minute and with no engine to start; with
``--peer``, vllm-router (``cache_aware``, one process per stand-in) over the same stand-ins, rounds
alternated, so the two routers' figures come from the same minutes of the same host.

    python -m bench.relay_cpu --interval-ms 30 300 --rounds 3 --peer

For each pace: rounds of ``streams`` concurrent chat streams of ``tokens`` tokens (with the usage chunk,
as ``vllm bench serve`` asks), each router's CPU over each round (every thread, from the scheduler's
counters) divided by its requests, and the share of it spent in the kernel (user and system ticks over
all rounds: the syscalls, and the loopback TCP delivery a send runs in its sender's time); before them,
each router's idle CPU per second. A round at a CPU engine's pace (30-300 ms per token) is one wake-up
per chunk; the idle share grows with the round's length."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.procs import sched_cpu_s, stop_all
from bench.router_ceiling import _async_redis, _count_chunks, _standin, _standin_node, _start_router
from bench.standin_engine import free_port
from bench.vllm_router import PeerWorker, VllmRouter
from contracts.config import redis_url as configured_redis_url
from contracts.registry import NodeInfo, NodeRegistry


@dataclass
class _Arm:
    """One router under measurement: its process and what it took, round by round."""

    name: str
    pid: int
    per_request_ms: dict[float, list[float]] = field(default_factory=dict)
    user_s: float = 0.0
    system_s: float = 0.0

    def times(self) -> tuple[float, float]:
        t = psutil.Process(self.pid).cpu_times()  # every thread's user and system ticks
        return t.user, t.system

    def idle_ms_per_s(self, window_s: float) -> float:
        cpu0, t0 = sched_cpu_s(self.pid), time.monotonic()
        time.sleep(window_s)  # the idle window itself: nothing to wait for
        return (sched_cpu_s(self.pid) - cpu0) * 1000 / (time.monotonic() - t0)

    def round(self, url: str, model: str, args: argparse.Namespace, pace: float) -> None:
        (user0, sys0), cpu0 = self.times(), sched_cpu_s(self.pid)
        asyncio.run(_count_chunks(url, model, args.streams, args.tokens, include_usage=True))
        (user1, sys1), cpu1 = self.times(), sched_cpu_s(self.pid)
        self.per_request_ms.setdefault(pace, []).append((cpu1 - cpu0) * 1000 / args.streams)
        self.user_s += user1 - user0
        self.system_s += sys1 - sys0

    def report(self, pace: float) -> str:
        per = self.per_request_ms[pace]
        return (
            f"{pace:g} ms per token: {self.name} CPU {sum(per) / len(per):.2f} ms per request "
            f"(rounds {', '.join(f'{p:.2f}' for p in per)})"
        )

    def kernel_share(self) -> str:
        total = self.user_s + self.system_s
        share = self.system_s / total if total else 0.0
        times = f"user {self.user_s:.2f} s, system {self.system_s:.2f} s"
        return f"{self.name}: {share:.0%} of its CPU in the kernel ({times})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval-ms", type=float, nargs="+", default=[30.0, 300.0], help="paces, ms per token")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--peer", action="store_true", help="vllm-router cache_aware over the same stand-ins too")
    ap.add_argument("--redis-url", default=configured_redis_url(db=11))
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="tandem-relay-cpu-"))
    procs: list[subprocess.Popen[bytes]] = []
    nodes: list[tuple[float, NodeInfo]] = []
    try:
        with contextlib.ExitStack() as peers:
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
            tandem = _Arm("router", router.pid)
            url = f"http://127.0.0.1:{port}"
            paces = [(pace, info, [(tandem, url)]) for pace, info in nodes]
            if args.peer:
                for pace, info, pairs in paces:
                    peer = peers.enter_context(_peer(info, workdir, pace))
                    pairs.append((_Arm(f"vllm-router ({pace:g} ms)", peer.proc.pid), peer.url))  # type: ignore[union-attr]
            _measure(paces, args)
    finally:
        stop_all(procs)
        for _, info in nodes:
            asyncio.run(NodeRegistry(_async_redis(args.redis_url), ttl_s=3600).deregister(info.node_id))


@contextlib.contextmanager
def _peer(info: NodeInfo, workdir: Path, pace: float) -> Iterator[VllmRouter]:
    peer = VllmRouter(
        port=free_port(),
        policy="cache_aware",
        workers=[PeerWorker(info.url, "", "")],
        block_size=info.block_size,
        model=info.model,
        log=workdir / f"vllm-router-{pace:g}.log",
        metrics_port=free_port(),
    )
    with peer:
        yield peer


def _measure(paces: list[tuple[float, NodeInfo, list[tuple[_Arm, str]]]], args: argparse.Namespace) -> None:
    """Warm each router, read its idle CPU, then each pace's rounds, alternating which router goes first.
    The Tandem router serves every pace; each vllm-router one."""
    arms = list({id(arm): arm for _, _, pairs in paces for arm, _ in pairs}.values())
    for _, info, pairs in paces:
        for _, url in pairs:
            asyncio.run(_count_chunks(url, info.model, 4, 8, include_usage=True))  # first use
    for arm in arms:
        print(f"{arm.name} idle: {arm.idle_ms_per_s(args.idle_s):.2f} ms of CPU per second", flush=True)
    for pace, info, pairs in paces:
        for i in range(args.rounds):
            for arm, url in pairs if i % 2 == 0 else pairs[::-1]:
                arm.round(url, info.model, args, pace)
        for arm, _ in pairs:
            print(arm.report(pace), flush=True)
    for arm in arms:
        print(arm.kernel_share(), flush=True)


if __name__ == "__main__":
    main()
