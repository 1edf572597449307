"""`tandem bench hosts`: ``bench chaos``'s schedule, and the faults only separate hosts can have, on the
lab (issue 38, item 6).

Cluster: ``infra.lab.cluster`` on a lab of its own (router, prefill, decode, colocated node, a store host
running Redis, PostgreSQL and the lake writer, a client host), every component bound to its host's
address and talking to the others over the lab's bridge. Load: ``bench.chaos_workload`` (closed-loop SSE
clients) run from the client host. The benchmark is the cluster's supervisor, as ``tandem up`` is on one
host: a router, lake writer or node whose process is gone is started again on its host.

Faults, in order (``FAULTS``; each after ``settle_s`` of steady service):

    sigkill_decode_engine    kill -9 the decode node's engine core (its agent restarts the engine)
    sigkill_prefill_engine   kill -9 the prefill node's engine core
    sigkill_node_agent       kill -9 the colocated node's agent (the supervisor starts it again)
    sigstop_engine           SIGSTOP the decode node's engine core for ``stop_s``, then SIGCONT
    sigkill_router           kill -9 the router (started again, with the same telemetry journal)
    sigkill_lake_writer      kill -9 the lake writer
    cut_decode_host          the decode host's link down for ``cut_s`` (a partition: packets vanish)
    cut_prefill_host         the prefill host's link down for ``cut_s``: pulls under way fail
    cut_store_host           Redis, PostgreSQL and the lake writer unreachable for ``cut_s``
    lose_decode_host         every process of the decode host SIGKILLed at once (a machine lost); the
                             supervisor starts the node again, as a rebooted machine would

``bench chaos``'s ``restart_redis`` is not on the lab's list: the lab's Redis keeps nothing on disk, and
the store host's cut covers Redis going away. ``FAULTS`` maps a name to its injector (``Hosts`` -> the
fault's target and the check that the target is back); a schedule with more hosts (the second region's
faults) adds its own entries.

Per fault and whole run: the same figures and RESULT line as ``bench chaos`` (``bench.chaos.fault_summary``:
faults, survived, hung streams, stranded blocks, lost lake rows, failed requests, failed elsewhere,
recovery p50 and max); ``recovery_s`` is fault -> back with full service (every process running, every
node registered and seen by the router, one request down each route answered), timed from the injection
(a cut's ``cut_s`` included).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import redis

from bench.chaos import FAULTS as CHAOS_FAULTS
from bench.chaos import (
    ChaosConfig,
    FaultResult,
    _running,
    engine_blocks_held,
    fault_doc,
    fault_summary,
    lake_failed_nodes,
    settle_to_zero,
    wait_ticking,
)
from bench.chaos_report import plot
from bench.chaos_workload import Request, Workload
from contracts.registry import NodeInfo, node_key
from infra.lab.cluster import NODES, SPEC, LabCluster, lab_cluster, node_id
from infra.lab.network import LabSpec

FAULT_NAMES = (
    *(f for f in CHAOS_FAULTS if f != "restart_redis"),
    *("cut_decode_host", "cut_prefill_host", "cut_store_host", "lose_decode_host"),
)
"""The default schedule, in order: bench chaos's, then the lab's own; ``FAULTS`` holds each one's injector."""
Injector = Callable[["Hosts"], tuple[str, Callable[[], bool]]]
"""Fires a fault; returns its target (a node id, or router, lake-writer, redis) and the check that the
target is back."""


@dataclass(frozen=True)
class HostsConfig(ChaosConfig):
    streams: int = 8
    settle_s: float = 15.0
    faults: tuple[str, ...] = FAULT_NAMES
    cut_s: float = 20.0
    """How long a cut host stays off the network (longer than a registry entry lives: 15 s)."""
    lab_name: str = "hst"
    net: int = 233
    """The lab's addresses: 10.<net>.0.0/24."""
    workdir: Path = Path(".tandem/bench-hosts")


class Hosts:
    """The lab cluster, its supervision, the faults and the measurements."""

    def __init__(self, cfg: HostsConfig, lc: LabCluster) -> None:
        self.cfg, self.lc = cfg, lc
        self.t0 = time.monotonic()
        self.events: list[str] = []

    # ---- supervision and waiting -------------------------------------------------------------------
    def supervise(self) -> None:
        """Start again, on its host, every router, lake writer or node whose process is gone."""
        restart: dict[str, Callable[[], None]] = {
            "router": self.lc.start_router,
            "lake-writer": self.lc.start_lake_writer,
            **{h: (lambda h=h: self.lc.start_node(h)) for h in NODES},  # type: ignore[misc]
        }
        for name, proc in list(self.lc.procs.items()):
            if name in restart and proc.poll() is not None:
                restart[name]()
                self.events.append(f"{time.monotonic() - self.t0:7.1f}s restarted {name} (exit {proc.returncode})")
                print(f"  supervisor: restarted {name}", flush=True)

    def wait_until(self, cond: Callable[[], bool], timeout_s: float, every_s: float = 1.0) -> bool:
        return wait_ticking(self.supervise, cond, timeout_s, every_s)

    def hold(self, seconds: float) -> None:
        self.wait_until(lambda: False, seconds, every_s=0.5)

    @contextlib.contextmanager
    def client(self, timeout: float = 10) -> Iterator[httpx.Client]:
        """An HTTP client on the client host (the calling thread there for the body)."""
        with self.lc.lab.inside("client"), httpx.Client(timeout=timeout) as http:
            yield http

    # ---- the cluster's parts -------------------------------------------------------------------------
    def epoch(self, host: str) -> int:
        with self.lc.lab.inside("client"), contextlib.suppress(redis.RedisError):
            client = redis.Redis.from_url(self.lc.redis_url, socket_timeout=2, socket_connect_timeout=2)
            try:
                raw: bytes | None = client.get(node_key(node_id(host)))  # type: ignore[assignment]
            finally:
                client.close()
            if raw is not None:
                return msgspec.msgpack.decode(raw, type=NodeInfo).epoch
        return 0

    def engine_core(self, host: str) -> psutil.Process:
        agent = psutil.Process(self.lc.procs[host].pid)
        return next(p for p in agent.children(recursive=True) if "EngineCor" in p.name())

    def full_service(self) -> bool:
        if self.lc.dead():
            return False
        try:
            if not self.lc.registered() >= {node_id(h) for h in NODES}:
                return False
            with self.client(timeout=30) as http:
                if self.lc.router_nodes(http) < len(NODES):
                    return False
                for route in ("disaggregated", "colocated"):
                    resp = http.post(
                        f"{self.lc.router_url}/v1/chat/completions",
                        headers={"x-tandem-route": route, "x-session-id": "hosts-probe"},
                        json={
                            "model": self.lc.model,
                            "max_tokens": 2,
                            "messages": [{"role": "user", "content": "ping"}],
                        },
                    )
                    if resp.status_code != 200:
                        return False
        except (httpx.HTTPError, redis.RedisError, ValueError):
            return False
        return True

    # ---- the run ---------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        load = Workload(self.lc.router_url, self.lc.model, cfg)
        self.t0 = time.monotonic()
        with self.lc.lab.inside("client"):
            load.start()  # its threads are started here: they are the client host's
        results: list[FaultResult] = []
        for fault in cfg.faults:
            self.hold(cfg.settle_s)
            print(f"{fault} at {time.monotonic() - self.t0:.0f} s", flush=True)
            t_fault = time.monotonic()
            target, back = FAULTS[fault](self)
            ok = self.wait_until(lambda back=back: back() and self.full_service(), cfg.recovery_timeout_s)
            recovery = round(time.monotonic() - t_fault, 1) if ok else None
            results.append(FaultResult(fault, round(t_fault - self.t0, 1), recovery, ok, target=target))
            print(f"  {'recovered' if ok else 'NOT recovered'} after {time.monotonic() - t_fault:.0f} s", flush=True)
            if not ok:
                break  # the cluster did not heal; the rest of the schedule would measure nothing
        self.hold(cfg.settle_s)
        load.finish()
        t_end = time.monotonic()
        requests = load.snapshot()
        stranded = self.stranded_blocks()
        lost, answered = self.lost_lake_rows(requests)
        nodes_of = lake_failed_nodes(self.lc.lake or self.cfg.workdir / "lake", requests)
        summary = fault_summary(cfg, self.t0, results, requests, stranded, lost, nodes_of)
        return fault_doc("hosts", cfg, summary, results, requests, (self.t0, t_end), answered, self.events)

    def stranded_blocks(self) -> int:
        """KV blocks held once every engine is idle (``bench.chaos.engine_blocks_held``), polled up to 60 s."""

        def held() -> int | None:
            try:
                with self.client() as http:
                    counts = [engine_blocks_held(http.get(f"{self.lc.engine_url(h)}/metrics").text) for h in NODES]
            except httpx.HTTPError:
                return None
            return None if None in counts else sum(c or 0 for c in counts)

        return settle_to_zero(self.wait_until, held)

    def lost_lake_rows(self, requests: list[Request]) -> tuple[int, int]:
        """(answered requests missing from the lake, answered requests), polled while the writer drains."""
        answered = {r.response_id for r in requests if r.outcome == "ok" and r.response_id}
        missing = [len(answered)]

        def drained() -> bool:
            missing[0] = len(answered - self.lc.lake_response_ids())
            return missing[0] == 0

        self.wait_until(drained, 120, every_s=2.0)
        return missing[0], len(answered)


# ---- the faults -------------------------------------------------------------------------------------------
def _kill_engine(host: str) -> Injector:
    def inject(h: Hosts) -> tuple[str, Callable[[], bool]]:
        before = h.epoch(host)
        h.engine_core(host).kill()
        return node_id(host), lambda: h.epoch(host) > before

    return inject


def _kill_agent(h: Hosts) -> tuple[str, Callable[[], bool]]:
    before, pid = h.epoch("colo"), h.lc.procs["colo"].pid
    os.kill(pid, signal.SIGKILL)
    return node_id("colo"), lambda: h.lc.procs["colo"].pid != pid and h.epoch("colo") > before


def _stop_engine(h: Hosts) -> tuple[str, Callable[[], bool]]:
    core, before = h.engine_core("decode"), h.epoch("decode")
    core.suspend()
    h.hold(h.cfg.stop_s)
    with contextlib.suppress(psutil.Error):
        core.resume()
    return node_id("decode"), lambda: h.epoch("decode") > before or _running(core)


def _kill_process(name: str) -> Injector:
    def inject(h: Hosts) -> tuple[str, Callable[[], bool]]:
        pid = h.lc.procs[name].pid
        os.kill(pid, signal.SIGKILL)
        return name, lambda: h.lc.procs[name].pid != pid and h.lc.procs[name].poll() is None

    return inject


def _cut(host: str, target: str) -> Injector:
    def inject(h: Hosts) -> tuple[str, Callable[[], bool]]:
        with h.lc.lab.partitioned(host):
            h.hold(h.cfg.cut_s)
        return target, lambda: True  # back once healed: full service decides the recovery

    return inject


def _lose_host(host: str) -> Injector:
    def inject(h: Hosts) -> tuple[str, Callable[[], bool]]:
        before = h.epoch(host)
        h.lc.lose_host(host)
        return node_id(host), lambda: h.epoch(host) > before

    return inject


FAULTS: dict[str, Injector] = {
    "sigkill_decode_engine": _kill_engine("decode"),
    "sigkill_prefill_engine": _kill_engine("prefill"),
    "sigkill_node_agent": _kill_agent,
    "sigstop_engine": _stop_engine,
    "sigkill_router": _kill_process("router"),
    "sigkill_lake_writer": _kill_process("lake-writer"),
    "cut_decode_host": _cut("decode", node_id("decode")),
    "cut_prefill_host": _cut("prefill", node_id("prefill")),
    "cut_store_host": _cut("store", "redis"),
    "lose_decode_host": _lose_host("decode"),
}


def run_hosts_bench(out: Path, cfg: HostsConfig | None = None) -> dict[str, Any]:
    cfg = cfg or HostsConfig()
    unknown = [f for f in cfg.faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = LabSpec(cfg.lab_name, SPEC.hosts, net=cfg.net)
    with lab_cluster(cfg.workdir.resolve(), spec, lake=True) as lc:
        doc = Hosts(cfg, lc).run()
    out.write_text(json.dumps(doc, indent=2))
    png = out.with_suffix(".png")
    plot(doc, png)
    print(f"wrote {out} and {png}", flush=True)
    return dict(doc["summary"])
