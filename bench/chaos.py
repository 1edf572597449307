"""`tandem bench chaos`: a steady agent workload while a schedule fires each fault once (issue 12).

Cluster: 1 prefill + 1 decode + 1 colocated node, router, lake writer, and a Redis of its own (the
benchmark restarts it, so it must not be the shared one), all started and kept up by the same
launcher code as `tandem up` (``Cluster.supervise`` runs between every step, from the main thread).
Load: ``streams`` closed-loop SSE clients (agent-like: a shared system prompt, a short question),
each waiting the answer's Retry-After (at most 2 s) after a failure, as OpenAI's clients do.

Faults, in order, each after the cluster has served steadily for ``settle_s``:

    sigkill_decode_engine    kill -9 the decode node's VLLM::EngineCore (its agent restarts the engine)
    sigkill_prefill_engine   kill -9 the prefill node's VLLM::EngineCore
    sigkill_node_agent       kill -9 the colocated node's agent (tandem up restarts it; its engine dies)
    sigstop_engine           SIGSTOP the decode node's engine core for ``stop_s``, then SIGCONT
    sigkill_router           kill -9 the router (tandem up restarts it)
    sigkill_lake_writer      kill -9 the lake writer (tandem up restarts it)
    restart_redis            SHUTDOWN SAVE of the cluster's Redis (tandem up restarts it; data kept)

Per fault:
    recovery_s       fault -> the component is back (a new epoch for an engine or agent, a new pid for a
                     process, a running engine after a stop) *and* full service: every child running,
                     every node registered and seen by the router, one request down each route answered
    failed           requests that ended without an answer between the fault and recovery + 5 s
    failed_elsewhere those of them that were not on the killed component: the lake row of a failed
                     request names its prefill and decode node; a node fault's failures must be on
                     that node. A killed router's streams are cut (its process holds their sockets)
                     while the surviving replica's failures are error events, so after a router fault
                     only a cut or refused request counts as its own. Requests with no lake row (none
                     got an id) are counted in ``failed_unattributed`` and judged by outcome alone.
    survived         recovery within ``recovery_timeout_s`` with no one touching the cluster
Whole run:
    hung_streams     requests that went ``hang_s`` without a byte (the client's read timeout)
    stranded_blocks  KV blocks still held once the engines are idle: sum over engines of KV usage x
                     blocks, plus blocks under a transfer lease (engine /metrics), polled up to 60 s
    lost_lake_rows   answered requests (response id seen by the client) with no row in the lake's
                     ``requests`` table, polled while the lake writer drains (up to 120 s)

Output: JSON (config, per-fault rows, timeline), a PNG timeline of answers/s and failures/s with the
faults marked, and the RESULT line
``RESULT faults=… survived=… hung_streams=… stranded_blocks=… lost_lake_rows=… failed_requests=…
failed_elsewhere=… recovery_p50_s=… recovery_max_s=…``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import redis
from rich.console import Console

from bench.chaos_report import plot, timeline
from bench.chaos_workload import Request, Workload
from contracts.registry import NodeInfo, node_key
from infra.launcher import Child, Cluster, ClusterSpec
from node_agent.engine_metrics import parse_metrics

console = Console(stderr=True)

FAULTS = (
    "sigkill_decode_engine",
    "sigkill_prefill_engine",
    "sigkill_node_agent",
    "sigstop_engine",
    "sigkill_router",
    "sigkill_lake_writer",
    "restart_redis",
)


@dataclass(frozen=True)
class ChaosConfig:
    streams: int = 16
    """Concurrent SSE clients."""
    max_tokens: int = 32
    settle_s: float = 20.0
    """Steady service before each fault (and before the first)."""
    stop_s: float = 30.0
    """How long the SIGSTOP fault keeps the engine stopped."""
    hang_s: float = 60.0
    """A stream without a byte for this long counts as hung."""
    recovery_timeout_s: float = 240.0
    """A fault whose component is not back with full service by then did not survive."""
    faults: tuple[str, ...] = FAULTS
    router_port: int = 19600
    node_base_port: int = 19610
    redis_port: int = 19695
    dtype: str = "float32"
    kv_cache_gib: int = 1
    workdir: Path = Path(".tandem/bench-chaos")


@dataclass(slots=True)
class FaultResult:
    fault: str
    at_s: float
    recovery_s: float | None = None
    survived: bool = False
    failed: int = 0
    failed_outcomes: dict[str, int] = field(default_factory=dict)
    target: str = ""
    """The component the fault hit: a node id, or router, lake-writer, redis."""
    failed_elsewhere: int = 0
    failed_unattributed: int = 0


class Chaos:
    """The cluster, the faults and the measurements; every wait ticks the launcher's supervision."""

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        spec = ClusterSpec(
            prefill=1,
            decode=1,
            both=1,
            router_port=cfg.router_port,
            node_base_port=cfg.node_base_port,
            redis_port=cfg.redis_port,
            embedded_redis=True,
            dtype=cfg.dtype,
            kv_cache_gib=cfg.kv_cache_gib,
            workdir=cfg.workdir,
        )
        self.cluster = Cluster(spec)
        self.t0 = time.monotonic()
        self.events: list[str] = []
        self.model = ""

    # ---- waiting, with the launcher kept running ------------------------------------------------

    def tick(self) -> None:
        for event in self.cluster.supervise():
            self.events.append(f"{time.monotonic() - self.t0:7.1f}s {event}")
            console.print(f"  launcher: {event}")

    def wait_until(self, cond: Callable[[], bool], timeout_s: float, every_s: float = 1.0) -> bool:
        return wait_ticking(self.tick, cond, timeout_s, every_s)

    def hold(self, seconds: float) -> None:
        self.wait_until(lambda: False, seconds, every_s=0.5)

    # ---- the cluster's parts ----------------------------------------------------------------------

    def child(self, name: str) -> Child:
        return next(c for c in self.cluster.children if c.name == name)

    def node_name(self, role: str) -> str:
        return next(n for n, r in self.cluster.node_ids.items() if r.value == role)

    def engine_core(self, node: str) -> psutil.Process:
        agent = psutil.Process(self.child(node).proc.pid)
        return next(p for p in agent.children(recursive=True) if "EngineCor" in p.name())

    def epoch(self, node: str) -> int:
        with contextlib.suppress(redis.RedisError):
            raw = redis.Redis.from_url(self.cluster.redis_url, socket_timeout=1).get(node_key(node))
            if raw is not None:
                return msgspec.msgpack.decode(raw, type=NodeInfo).epoch
        return 0

    def full_service(self) -> bool:
        if any(c.proc.poll() is not None for c in self.cluster.children):
            return False
        try:
            if self.cluster.live_node_ids() != set(self.cluster.node_ids):
                return False
            health = httpx.get(f"{self.cluster.url}/health", timeout=2).json()
            if sum(health.get("nodes", {}).values()) < len(self.cluster.node_ids):
                return False
            for route in ("disaggregated", "colocated"):
                resp = httpx.post(
                    f"{self.cluster.url}/v1/chat/completions",
                    timeout=30,
                    headers={"x-tandem-route": route, "x-session-id": "chaos-probe"},
                    json={"model": self.model, "max_tokens": 2, "messages": [{"role": "user", "content": "ping"}]},
                )
                if resp.status_code != 200:
                    return False
        except (httpx.HTTPError, redis.RedisError, ValueError):
            return False
        return True

    # ---- faults -------------------------------------------------------------------------------------

    def target_of(self, fault: str) -> str:
        """The component ``fault`` hits (see ``inject``)."""
        if fault in ("sigkill_decode_engine", "sigstop_engine"):
            return self.node_name("decode")
        if fault == "sigkill_prefill_engine":
            return self.node_name("prefill")
        if fault == "sigkill_node_agent":
            return self.node_name("both")
        return {"sigkill_router": "router", "sigkill_lake_writer": "lake-writer", "restart_redis": "redis"}[fault]

    def inject(self, fault: str) -> Callable[[], bool]:
        """Fire ``fault``; returns the check that its component is back."""
        if fault in ("sigkill_decode_engine", "sigkill_prefill_engine"):
            node = self.node_name("decode" if fault == "sigkill_decode_engine" else "prefill")
            before = self.epoch(node)
            self.engine_core(node).kill()
            return lambda: self.epoch(node) > before
        if fault == "sigkill_node_agent":
            node = self.node_name("both")
            before, pid = self.epoch(node), self.child(node).proc.pid
            os.kill(pid, signal.SIGKILL)
            return lambda: self.child(node).proc.pid != pid and self.epoch(node) > before
        if fault == "sigstop_engine":
            node = self.node_name("decode")
            core = self.engine_core(node)
            before = self.epoch(node)
            core.suspend()
            self.hold(self.cfg.stop_s)
            with contextlib.suppress(psutil.Error):
                core.resume()
            return lambda: self.epoch(node) > before or _running(core)
        if fault in ("sigkill_router", "sigkill_lake_writer", "restart_redis"):
            name = {"sigkill_router": "router", "sigkill_lake_writer": "lake-writer", "restart_redis": "redis"}[fault]
            pid = self.child(name).proc.pid
            if fault == "restart_redis":
                with contextlib.suppress(redis.RedisError):
                    redis.Redis.from_url(self.cluster.redis_url, socket_timeout=5).shutdown(save=True)
            else:
                os.kill(pid, signal.SIGKILL)
            return lambda: self.child(name).proc.pid != pid and self.child(name).proc.poll() is None
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")

    # ---- the run --------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.cluster.start()
        try:
            with console.status("starting the chaos cluster (1P + 1D + 1 colocated)…") as status:
                self.cluster.wait_ready(on_progress=lambda m: status.update(f"starting the chaos cluster… {m}"))
            self.model = httpx.get(f"{self.cluster.url}/v1/models", timeout=10).json()["data"][0]["id"]
            load = Workload(self.cluster.url, self.model, cfg)
            self.t0 = time.monotonic()
            load.start()
            results: list[FaultResult] = []
            for fault in cfg.faults:
                self.hold(cfg.settle_s)
                console.print(f"[bold]{fault}[/bold] at {time.monotonic() - self.t0:.0f} s")
                t_fault = time.monotonic()
                back = self.inject(fault)
                ok = self.wait_until(lambda back=back: back() and self.full_service(), cfg.recovery_timeout_s)
                res = FaultResult(
                    fault,
                    target=self.target_of(fault),
                    at_s=round(t_fault - self.t0, 1),
                    survived=ok,
                    recovery_s=round(time.monotonic() - t_fault, 1) if ok else None,
                )
                results.append(res)
                console.print(f"  {'recovered' if ok else 'NOT recovered'} after {time.monotonic() - t_fault:.0f} s")
                if not ok:
                    break  # the cluster did not heal; the rest of the schedule would measure nothing
            self.hold(cfg.settle_s)
            load.finish()
            t_end = time.monotonic()
            stranded = self.stranded_blocks()
            lost, answered = self.lost_lake_rows(load.snapshot())
            nodes_of = self.failed_nodes(load.snapshot())
        finally:
            self.cluster.stop()
        return self.summarise(cfg, results, load.snapshot(), t_end, stranded, lost, answered, nodes_of)

    def stranded_blocks(self) -> int:
        """KV blocks held once every engine is idle (polled up to 60 s: leases end within their TTL)."""

        def held() -> int | None:
            total = 0
            for url in self.cluster.node_urls.values():
                try:
                    n = engine_blocks_held(httpx.get(f"{url}/metrics", timeout=5).text)
                except httpx.HTTPError:
                    return None
                if n is None:
                    return None
                total += n
            return total

        return settle_to_zero(self.wait_until, held)

    def lost_lake_rows(self, requests: list[Request]) -> tuple[int, int]:
        """(answered requests missing from the lake, answered requests), polled while the writer drains."""
        import duckdb

        from telemetry.query import query

        answered = {r.response_id for r in requests if r.outcome == "ok" and r.response_id}
        missing: list[int] = [len(answered)]

        def drained() -> bool:
            try:
                rows = query(self.cluster.lake, "SELECT DISTINCT response_id FROM requests").column(0).to_pylist()
            except (duckdb.Error, OSError):  # a part renamed or compacted under the query: poll again
                return False
            missing[0] = len(answered - set(rows))
            return missing[0] == 0

        self.wait_until(drained, 120, every_s=2.0)
        return missing[0], len(answered)

    def failed_nodes(self, requests: list[Request]) -> dict[str, set[str]]:
        return lake_failed_nodes(self.cluster.lake, requests)

    @staticmethod
    def on_target(res: FaultResult, req: Request, nodes_of: dict[str, set[str]]) -> bool | None:
        """Whether a failed request was on the component ``res`` hit; None when nothing tells."""
        if res.target in ("router", "lake-writer", "redis"):
            # The killed router's own streams are the ones cut; nothing else ever justifies a failure.
            return res.target == "router" and req.outcome in ("cut", "refused")
        nodes = nodes_of.get(req.response_id or "")
        if nodes is None:
            return None
        return res.target in nodes

    def summarise(
        self,
        cfg: ChaosConfig,
        results: list[FaultResult],
        requests: list[Request],
        t_end: float,
        stranded: int,
        lost: int,
        answered: int,
        nodes_of: dict[str, set[str]] | None = None,
    ) -> dict[str, Any]:
        summary = fault_summary(cfg, self.t0, results, requests, stranded, lost, nodes_of or {})
        return fault_doc("chaos", cfg, summary, results, requests, (self.t0, t_end), answered, self.events)


def lake_failed_nodes(lake: Path, requests: list[Request]) -> dict[str, set[str]]:
    """Response id of each failed request -> the nodes its lake row names (prefill and decode)."""
    import duckdb

    from telemetry.query import query

    ids = sorted({r.response_id for r in requests if r.outcome not in ("ok", "running") and r.response_id})
    if not ids:
        return {}
    listed = ", ".join("'" + i.replace("'", "''") + "'" for i in ids)
    try:
        table = query(
            lake, f"SELECT response_id, prefill_node, decode_node FROM requests WHERE response_id IN ({listed})"
        )
    except (duckdb.Error, OSError) as exc:
        console.print(f"  could not read the failed requests' lake rows: {exc}")
        return {}
    out: dict[str, set[str]] = {}
    for rid, pre, dec in zip(*(table.column(i).to_pylist() for i in range(3)), strict=True):
        out.setdefault(rid, set()).update(n for n in (pre, dec) if n)
    return out


def fault_summary(
    cfg: ChaosConfig,
    t0: float,
    results: list[FaultResult],
    requests: list[Request],
    stranded: int,
    lost: int,
    nodes_of: dict[str, set[str]],
) -> dict[str, Any]:
    """Each fault's failed requests (those that ended between it and its recovery + 5 s, judged on or off
    its target by ``Chaos.on_target``), filled into ``results``; returns the RESULT fields."""
    for res in results:
        lo = t0 + res.at_s
        hi = lo + (res.recovery_s if res.recovery_s is not None else cfg.recovery_timeout_s) + 5
        bad = [r for r in requests if r.outcome not in ("ok", "running") and lo <= r.end <= hi]
        res.failed = len(bad)
        res.failed_outcomes = {o: sum(1 for r in bad if r.outcome == o) for o in sorted({r.outcome for r in bad})}
        verdicts = [Chaos.on_target(res, r, nodes_of) for r in bad]
        res.failed_elsewhere = sum(1 for v in verdicts if v is False)
        res.failed_unattributed = sum(1 for v in verdicts if v is None)
    recoveries = [r.recovery_s for r in results if r.recovery_s is not None]
    return {
        "faults": len(cfg.faults),
        "survived": sum(r.survived for r in results),
        "hung_streams": sum(1 for r in requests if r.outcome == "hung"),
        "stranded_blocks": stranded,
        "lost_lake_rows": lost,
        "failed_requests": sum(1 for r in requests if r.outcome not in ("ok", "running")),
        "failed_elsewhere": sum(r.failed_elsewhere for r in results),
        "recovery_p50_s": round(statistics.median(recoveries), 1) if recoveries else None,
        "recovery_max_s": max(recoveries) if recoveries else None,
    }


def fault_doc(
    benchmark: str,
    cfg: ChaosConfig,
    summary: dict[str, Any],
    results: list[FaultResult],
    requests: list[Request],
    span: tuple[float, float],
    answered: int,
    events: list[str],
) -> dict[str, Any]:
    """A fault benchmark's JSON document: config, summary, per-fault rows and the timeline over ``span``."""
    return {
        "benchmark": benchmark,
        "time": time.time(),
        "config": {**asdict(cfg), "workdir": str(cfg.workdir)},
        "summary": summary,
        "faults": [asdict(r) for r in results],
        "answered": answered,
        "requests": len(requests),
        "timeline": timeline(requests, *span),
        "launcher_events": events,
    }


def wait_ticking(tick: Callable[[], None], cond: Callable[[], bool], timeout_s: float, every_s: float = 1.0) -> bool:
    """Whether ``cond`` held within ``timeout_s``, the cluster's supervision (``tick``) run between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        tick()
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)  # polling processes and HTTP endpoints that offer no notification


def engine_blocks_held(metrics_text: str) -> int | None:
    """KV blocks an engine holds (KV usage x blocks, plus blocks under a transfer lease), from its
    ``/metrics``; None while it runs or queues a request (its blocks are in use, not stranded)."""
    snap = parse_metrics(metrics_text)
    if snap.running or snap.waiting:
        return None
    return round(snap.kv_usage * snap.num_kv_blocks) + _leased(metrics_text)


def settle_to_zero(
    wait_until: Callable[[Callable[[], bool], float], bool], held: Callable[[], int | None], timeout_s: float = 60
) -> int:
    """``held()`` polled (through ``wait_until``) until it is 0 or ``timeout_s`` passes: its last value, -1
    when it never had one (leases end within their TTL, so what is still held then is stranded)."""
    last: list[int | None] = [None]

    def zero() -> bool:
        last[0] = held()
        return last[0] == 0

    wait_until(zero, timeout_s)
    return last[0] if last[0] is not None else -1


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _leased(metrics_text: str) -> int:
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("tandem_kv_leased_blocks"):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
    return int(total)

    # t_s is each bin's start; the plot draws a bin at its middle.


def run_chaos_bench(out: Path, cfg: ChaosConfig | None = None) -> dict[str, Any]:
    cfg = cfg or ChaosConfig()
    unknown = [f for f in cfg.faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = Chaos(cfg).run()
    out.write_text(json.dumps(doc, indent=2))
    png = out.with_suffix(".png")
    plot(doc, png)
    console.print(f"wrote {out} and {png}")
    return doc["summary"]
