"""``tandem up``: a whole cluster on this machine (Redis if needed, N prefill, M decode, K colocated
nodes, one router) as child processes, stopped together on Ctrl-C / SIGTERM.

Also the fixture behind the end-to-end tests and benchmarks, which need the same real processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from infra.errors import ConfigError
from infra.redis_server import reachable, start_embedded
from infra.registry import NODES_SET, Role, node_key


@dataclass(frozen=True)
class ClusterSpec:
    prefill: int = 1
    decode: int = 1
    both: int = 0
    model: str | None = None
    router_port: int = 8000
    node_base_port: int = 8100
    """Node i listens on node_base_port + 10*i (its side ports are the next three)."""
    redis_url: str | None = None
    """None: redis://127.0.0.1:6379/0 if it answers, else an embedded server on redis_port."""
    redis_port: int = 6390
    dtype: str = "bfloat16"
    kv_cache_gib: int = 1
    connector: str = "tandem"
    max_model_len: int = 8192
    block_size: int | None = None
    """KV block size of every node; None keeps the engine's default (128 on CPU)."""
    policy: str = "cache_aware"
    workdir: Path = field(default_factory=lambda: Path(".tandem"))
    lake: Path | None = None
    """Parquet lake the cluster's telemetry writer fills; None: <workdir>/lake. Telemetry is always on:
    the emitters never block serving, so there is no reason to run without the records."""
    startup_timeout_s: float = 600.0
    extra_node_args: tuple[str, ...] = ()
    router_env: tuple[tuple[str, str], ...] = ()

    @property
    def roles(self) -> list[Role]:
        return [Role.PREFILL] * self.prefill + [Role.DECODE] * self.decode + [Role.BOTH] * self.both


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _span(chosen: list[int]) -> str:
    return f"{chosen[0]}-{chosen[-1]}" if len(chosen) > 1 else str(chosen[0])


def assign_cores(role: Role, has_pd: bool, slot: int = 0, slots: int = 1) -> str:
    """P and D get disjoint halves of the machine's cores, so a prefill burst never steals decode's
    core. Colocated nodes without a P/D pair split all cores between them (``slot`` of ``slots``;
    one node alone gets all of them); beside a P/D pair a colocated node shares decode's half: OpenMP
    threads spread over cores that other engines also use stall each other at every barrier
    (measured: 40 tokens took 58 s instead of 2 s on two shared cores)."""
    cores = _cores()
    if not has_pd and role is Role.BOTH:
        if slots <= 1 or len(cores) < 2:
            return _span(cores)
        if slots >= len(cores):
            return str(cores[slot % len(cores)])
        share = len(cores) // slots
        return _span(cores[slot * share:(slot + 1) * share])
    if len(cores) < 2:
        return _span(cores)
    half = len(cores) // 2
    return _span(cores[:half] if role is Role.PREFILL else cores[half:])


class Cluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.redis_url = spec.redis_url or "redis://127.0.0.1:6379/0"
        self.node_urls: dict[str, str] = {}
        self.node_ids: dict[str, Role] = {}
        self.logs = spec.workdir / "logs"
        self.lake = spec.lake or spec.workdir / "lake"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.router_port}"

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen([sys.executable, "-m", "infra.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append((name, proc))

    def start(self) -> None:
        spec = self.spec
        if spec.redis_url is None and not reachable(self.redis_url):
            self.redis_url = f"redis://127.0.0.1:{spec.redis_port}/0"
            self.procs.append(("redis", start_embedded(spec.redis_port, spec.workdir / "redis")))
        elif not reachable(self.redis_url):
            raise ConfigError(f"Redis at {self.redis_url} does not answer")
        has_pd = spec.prefill > 0 and spec.decode > 0
        both_slot = 0
        for i, role in enumerate(spec.roles):
            port = spec.node_base_port + 10 * i
            node_id = f"{role.value}-{i}-{port}"
            self.node_urls[node_id] = f"http://127.0.0.1:{port}"
            self.node_ids[node_id] = role
            args = ["node", "--role", role.value, "--port", str(port), "--node-id", node_id,
                    "--redis-url", self.redis_url, "--dtype", spec.dtype, "--kv-cache-gib", str(spec.kv_cache_gib),
                    "--cores", assign_cores(role, has_pd, both_slot, spec.both), "--connector", spec.connector,
                    "--max-model-len", str(spec.max_model_len), "--log-dir", str(self.logs)]
            if spec.model:
                args += ["--model", spec.model]
            if spec.block_size:
                args += ["--block-size", str(spec.block_size)]
            for extra in spec.extra_node_args:
                args += ["--engine-arg", extra]
            both_slot += role is Role.BOTH
            self._spawn(node_id, args)
        self.add_router(spec.router_port, spec.policy, name="router")
        # The slow path never takes CPU from the fast path: the writer runs SCHED_IDLE on any core
        # (every core belongs to an engine here), only where an engine would leave it idle.
        self._spawn("lake-writer", ["telemetry", "consume", "--redis-url", self.redis_url, "--lake", str(self.lake),
                                    "--consumer", f"tandem-up-{spec.router_port}", "--cpu-priority", "idle"])

    def add_router(self, port: int, policy: str, name: str | None = None) -> str:
        """Start a router process over this cluster's registry (the cluster's own, or another replica
        with its own policy, e.g. for a benchmark); returns its base URL. Every replica subscribes to
        the nodes' KV events itself. Stopped with the cluster."""
        self._spawn(name or f"router-{port}", ["router", "--port", str(port), "--redis-url", self.redis_url,
                                               "--policy", policy],
                    {"TANDEM_SQLITE_PATH": str(self.spec.workdir / "tandem.db"), **dict(self.spec.router_env)})
        return f"http://127.0.0.1:{port}"

    def live_node_ids(self) -> set[str]:
        client = redis.Redis.from_url(self.redis_url)
        try:
            ids = [m.decode() for m in client.smembers(NODES_SET)]
            return {i for i in ids if client.exists(node_key(i))}
        finally:
            client.close()

    def dead_children(self) -> list[str]:
        return [f"{name} (exit {p.returncode})" for name, p in self.procs if p.poll() is not None]

    def wait_ready(self, on_progress=None) -> None:  # noqa: ANN001 - callable(str) for progress display
        deadline = time.monotonic() + self.spec.startup_timeout_s
        want = set(self.node_ids)
        while time.monotonic() < deadline:
            dead = self.dead_children()
            if dead:
                raise ConfigError(f"cluster process died during start-up: {', '.join(dead)}; logs in {self.logs}")
            live = self.live_node_ids() & want
            router_ok = False
            with contextlib.suppress(httpx.HTTPError):
                router_ok = httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200
            if on_progress:
                on_progress(f"nodes ready {len(live)}/{len(want)}, router {'up' if router_ok else 'starting'}")
            if live == want and router_ok and self._router_sees(want):
                self._warm_up()
                return
            time.sleep(1.0)  # polling child processes that have no readiness callback
        raise ConfigError(f"cluster not ready after {self.spec.startup_timeout_s:.0f} s; logs in {self.logs}")

    def wait_router(self, url: str, timeout_s: float = 120.0) -> None:
        """Wait until a router started with ``add_router`` sees every node, then warm it up."""
        deadline = time.monotonic() + timeout_s
        while not self._router_sees(set(self.node_ids), url):
            dead = self.dead_children()
            if dead or time.monotonic() > deadline:
                raise ConfigError(f"router at {url} not ready ({', '.join(dead) or 'timeout'}); logs in {self.logs}")
            time.sleep(0.5)  # polling a child process that has no readiness callback
        self._warm_up(url)

    def _warm_up(self, url: str | None = None) -> None:
        """One tiny request down each path before saying READY, so the first user request does not pay
        one-off costs (the router loading the tokenizer, the first NIXL handshake between P and D)."""
        url = url or self.url
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        routes = (["disaggregated"] if self.spec.prefill and self.spec.decode else []) + (
            ["colocated"] if self.spec.both else [])
        for route in routes:
            resp = httpx.post(f"{url}/v1/chat/completions", timeout=self.spec.startup_timeout_s,
                              headers={"x-tandem-route": route, "x-session-id": "tandem-warm-up"},
                              json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            if resp.status_code != 200:
                raise ConfigError(f"warm-up request ({route}) failed: {resp.status_code} {resp.text[:300]}")

    def _router_sees(self, want: set[str], url: str | None = None) -> bool:
        """The router's own view includes every node (its registry refresh has caught up)."""
        with contextlib.suppress(httpx.HTTPError, ValueError):
            nodes = httpx.get(f"{url or self.url}/health", timeout=1.0).json().get("nodes", {})
            return sum(nodes.values()) >= len(want)
        return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """Router first (no new work), then nodes (they deregister), then an embedded Redis."""
        order = sorted(self.procs, key=lambda np: (np[0] == "redis", not np[0].startswith("router")))
        for name, proc in order:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            if name == "redis" or name.startswith("router"):
                _wait(proc, timeout_s)
        for _, proc in order:
            _wait(proc, timeout_s)
        self.procs.clear()

    def role_urls(self, role: str) -> list[str]:
        """Engine URLs of this cluster's nodes of one role (prefill, decode, both), in start order."""
        return [url for node_id, url in self.node_urls.items() if self.node_ids[node_id].value == role]

    def __enter__(self) -> Cluster:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
