"""``tandem up``: a whole cluster on this machine (Redis if needed, N prefill, M decode, K colocated
nodes, router replicas sharing one port, the lake writer) as child processes, kept up, stopped
together on Ctrl-C / SIGTERM.

Also the fixture behind the end-to-end tests and benchmarks, which need the same real processes.

Children and their lifetimes
    Every child runs in its own session (one ``killpg`` reaches whatever it starts) and carries a
    parent-death signal (``node_agent.lifetime.die_with_parent``): if the launcher dies, even by SIGKILL,
    each child gets SIGTERM, and a node agent then stops its engine, whose own parent-death signal
    covers the agent's death. ``stop`` signals the router first (no new work), then the nodes (they
    deregister), then an embedded Redis, waits for each, and finally SIGKILLs any descendant still
    alive, so nothing of the cluster outlives it or holds its ports.

Keeping it up (``supervise``, called by ``tandem up`` once the cluster is ready)
    A child that exits is started again with the same arguments after a backoff that doubles per
    exit in ``CHILD_FAILURE_WINDOW_S`` (1 s, 2 s, ... capped at ``CHILD_BACKOFF_MAX_S``); one dead
    child never stops the others. A node agent that exits with ``EXIT_UNHEALTHY`` gave up on its
    engine after its own restarts: it is left down and reported. Each restart is printed and written
    with the children's states to Redis (``tandem:launcher:<router port>``), which
    ``tandem cluster status`` shows. During start-up (``wait_ready``) a dead child is still fatal:
    that is a configuration problem (a taken port, a missing model), not a crash to ride out.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import redis

from contracts.cluster import CLUSTER_ENV, DEFAULT_CLUSTER, key, runtime_dir, validate
from contracts.config import redis_url as configured_redis_url
from contracts.errors import ConfigError
from contracts.models_file import check_models, read_models_file
from contracts.registry import Role, node_key, nodes_set
from host_tier.settings import TierSettings, layout_from_model
from infra.redis_server import reachable, start_embedded
from node_agent.dtype import resolve_dtype
from node_agent.lifetime import die_with_parent
from node_agent.model import default_model_dir
from node_agent.supervisor import EXIT_UNHEALTHY, describe_exit

CHILD_BACKOFF_S = 1.0
"""Delay before restarting a child after its first exit in the window; doubles per further exit."""
CHILD_BACKOFF_MAX_S = 30.0
CHILD_FAILURE_WINDOW_S = 300.0
"""Exits older than this no longer lengthen the backoff."""


def launcher_key(router_port: int, cluster: str = DEFAULT_CLUSTER) -> str:
    """Redis hash of a ``tandem up``'s children: name -> JSON state (see ``Child.state``)."""
    return key(cluster, "launcher", str(router_port))


@dataclass
class Child:
    """One process of the cluster and how to start it again."""

    name: str
    start: Callable[[], subprocess.Popen[bytes]]
    proc: subprocess.Popen[bytes]
    is_node: bool = False
    restarts: int = 0
    last_exit: str | None = None
    restart_at: float | None = None
    """Monotonic time of the pending restart, while it waits out its backoff."""
    gave_up: bool = False
    exits: deque[float] = field(default_factory=deque)
    descendants: list[psutil.Process] = field(default_factory=list)
    """What the child had started, as last seen alive (a node agent's engine)."""

    def state(self) -> dict[str, object]:
        alive = self.proc.poll() is None
        state = "running" if alive else ("unhealthy" if self.gave_up else "restarting")
        return {
            "state": state,
            "pid": self.proc.pid if alive else None,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "updated_at": time.time(),
        }


@dataclass(frozen=True)
class ModelSpec:
    """One served model of a several-model cluster: its nodes serve ``path`` as ``name``."""

    name: str
    """The served name (``--served-model-name``): what clients put in ``model``."""
    path: str | None = None
    """Model folder; None: the prepared default model."""
    dtype: str | None = None
    """Engine dtype of this model's nodes; None: the cluster's ``dtype``."""


def parse_model_option(value: str) -> ModelSpec:
    """``tandem up --model NAME=PATH`` (PATH empty: the prepared default model)."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"--model {value!r}: expected NAME=PATH (or a folder alone, for one model)")
    return ModelSpec(name=name.strip(), path=path.strip() or None)


def models_from_file(path: Path) -> tuple[ModelSpec, ...]:
    """The ``[served]`` models of a models file (``contracts.models_file``), checked as the router
    will check it, before any node starts."""
    spec = read_models_file(path)
    check_models(spec, str(path))
    return tuple(ModelSpec(name, m.path or None, m.dtype) for name, m in spec.served.items())


@dataclass(frozen=True)
class ClusterSpec:
    prefill: int = 1
    decode: int = 1
    both: int = 0
    model: str | None = None
    models: tuple[ModelSpec, ...] = ()
    """Several served models: ``prefill``/``decode``/``both`` nodes of each (``model`` is then unused).
    Empty: one model, ``model``, under its folder's name."""
    models_file: Path | None = None
    """The routers' model table (``TANDEM_ROUTER_MODELS``: aliases, fallbacks, canaries)."""
    router_port: int = 8000
    cluster: str | None = None
    """The cluster's name (``contracts.cluster``), given to every child as ``TANDEM_CLUSTER``; None: derived
    from ``router_port`` (``default`` on 8000, else ``p<port>``)."""
    node_base_port: int = 8100
    """Node i listens on node_base_port + 10*i (its side ports are the next three)."""
    redis_url: str | None = None
    """None: ``TANDEM_REDIS_URL`` (``contracts.config``) if it answers, else an embedded server on redis_port."""
    redis_port: int = 6390
    embedded_redis: bool = False
    """Start an embedded Redis on redis_port even if one answers at redis_url or the default (a
    benchmark that restarts Redis must own the one it restarts)."""
    dtype: str | None = None
    """Engine settings of every node; None leaves each to the node's own setting (``TANDEM_NODE_DTYPE``
    and so on in the environment, else ``NodeSettings``' default)."""
    kv_cache_gib: int | None = None
    connector: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    """KV block size of every node; None keeps the engine's default (128 on CPU)."""
    policy: str | None = None
    """The router's routing policy; None leaves it to ``TANDEM_ROUTER_POLICY``, else cache_aware."""
    workdir: Path = field(default_factory=lambda: Path(".tandem"))
    lake: Path | None = None
    """Parquet lake the cluster's telemetry writer fills; None: <workdir>/lake. Telemetry is always on:
    the emitters never block serving, so there is no reason to run without the records."""
    startup_timeout_s: float = 600.0
    extra_node_args: tuple[str, ...] = ()
    router_env: tuple[tuple[str, str], ...] = ()
    node_env: tuple[tuple[str, str], ...] = ()
    """Environment of every node process on top of this one's (``TANDEM_NODE_*`` settings)."""
    host_tier: str | None = None
    """Size of a host tier every node shares (``2GiB``; ``tandem tier serve``); None: no host tier.
    Off by default, with ``peer_kv``, by measurement: they pay only when the sessions' shared contexts
    outgrow the engines' own KV caches, or a node must load a prefix another computed. On a 2-core host,
    two one-core nodes with 1 GiB of KV each, agent sessions over three repositories of ~1.5k shared
    tokens (``tandem bench fleet``, 2 rounds): the same hit with both on (0.821), 16.7 sessions per
    minute against 20.6 and client ITL p50 69 ms against 50 ms (the connector a peer-fetching node runs
    costs every engine step). Turn them on when the working set exceeds the nodes' KV caches."""
    tier_env: tuple[tuple[str, str], ...] = ()
    """Environment of the host tier's process on top of this one's (``TANDEM_TIER_*`` settings)."""
    keep_host_tier: bool = False
    """Leave the tier's file (its blocks, and the RAM they take in /dev/shm) after ``stop``, for the next
    start to find; by default a stopped cluster gives the RAM back."""
    peer_kv: bool = False
    """Colocated nodes run our connector, so each loads a prefix another holds instead of computing it
    (``NodeSettings.peer_kv``; the router's ``peer_fetch``)."""
    routers: int | None = None
    """Router replicas sharing router_port (SO_REUSEPORT): one that dies, or restarts, leaves the other
    serving. The first is named ``router``, the others ``router-1``... None: ``default_routers()``."""

    @property
    def router_count(self) -> int:
        return self.routers if self.routers is not None else default_routers()

    @property
    def model_paths(self) -> list[str]:
        """The model folders the nodes register, which every router warms before it serves."""
        paths = [m.path for m in self.models] if self.models else [self.model]
        return [str(Path(p).expanduser()) if p else str(default_model_dir()) for p in paths]

    @property
    def roles(self) -> list[Role]:
        """The roles of one model's nodes."""
        return [Role.PREFILL] * self.prefill + [Role.DECODE] * self.decode + [Role.BOTH] * self.both

    @property
    def nodes(self) -> list[tuple[Role, ModelSpec | None]]:
        """Every node to start: its role and served model (None: the single ``model``)."""
        if not self.models:
            return [(role, None) for role in self.roles]
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError(f"served model names must differ: {', '.join(names)}")
        return [(role, m) for m in self.models for role in self.roles]


SMALL_HOST_CORES = 2
"""Hosts of this many cores or fewer run one router replica by default (``default_routers``)."""


def default_routers() -> int:
    """One router replica on a host of ``SMALL_HOST_CORES`` or fewer, two elsewhere. On a small host every
    core computes for an engine, and a second replica is one more process taking turns on them (its
    registry refresh, its KV-event subscriptions, its share of the streams) and about 0.7 GB. Measured
    on a 2-core host with warmed replicas (``tandem bench fleet --arm tandem --rounds 1 --routers R``,
    two one-core nodes, runs alternating 2, 1, 2, 1): one replica 21.5 and 23.3 sessions per minute,
    TTFT p99 2.1 and 1.9 s; two replicas 19.4 and 21.3, TTFT p99 3.1 and 2.0 s. A replica restarts
    within seconds when it dies (``supervise``); on larger hosts the second one keeps serving meanwhile."""
    return 1 if len(_cores()) <= SMALL_HOST_CORES else 2


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
        return _span(cores[slot * share : (slot + 1) * share])
    if len(cores) < 2:
        return _span(cores)
    half = len(cores) // 2
    return _span(cores[:half] if role is Role.PREFILL else cores[half:])


class Cluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.name = validate(spec.cluster) if spec.cluster else DEFAULT_CLUSTER
        """Every child runs with ``TANDEM_CLUSTER`` set to it: its Redis keys and host paths are this cluster's."""
        self.children: list[Child] = []
        self.redis_url = spec.redis_url or configured_redis_url()
        self.node_urls: dict[str, str] = {}
        self.node_ids: dict[str, Role] = {}
        self.logs = spec.workdir / "logs"
        self.lake = spec.lake or spec.workdir / "lake"
        self._state_client: redis.Redis | None = None
        self._next_snapshot = 0.0
        self._tier_file: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.router_port}"

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        """(name, current process) of every child."""
        return [(c.name, c.proc) for c in self.children]

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)

        def start() -> subprocess.Popen[bytes]:
            with open(self.logs / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
                return subprocess.Popen(
                    [sys.executable, "-m", "tandem", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, CLUSTER_ENV: self.name, **(env or {})},
                    start_new_session=True,
                    preexec_fn=die_with_parent(),
                )

        self.children.append(Child(name, start, start(), is_node=args[0] == "node"))

    def start(self) -> None:
        spec = self.spec
        if spec.embedded_redis or (spec.redis_url is None and not reachable(self.redis_url)):
            self.redis_url = f"redis://127.0.0.1:{spec.redis_port}/0"

            def start_redis() -> subprocess.Popen[bytes]:
                return start_embedded(spec.redis_port, spec.workdir / "redis")

            self.children.append(Child("redis", start_redis, start_redis()))
        elif not reachable(self.redis_url):
            raise ConfigError(f"Redis at {self.redis_url} does not answer")
        has_pd = spec.prefill > 0 and spec.decode > 0
        tier_endpoint = self._start_host_tier() if spec.host_tier else None
        both_slot = 0
        nodes = spec.nodes
        both_slots = sum(role is Role.BOTH for role, _ in nodes)
        for i, (role, served) in enumerate(nodes):
            port = spec.node_base_port + 10 * i
            node_id = f"{role.value}-{i}-{port}"
            self.node_urls[node_id] = f"http://127.0.0.1:{port}"
            self.node_ids[node_id] = role
            args = [
                "node",
                "--role",
                role.value,
                "--port",
                str(port),
                "--node-id",
                node_id,
                "--redis-url",
                self.redis_url,
                "--cores",
                assign_cores(role, has_pd, both_slot, both_slots),
                "--log-dir",
                str(self.logs),
            ]
            for flag, value in (
                ("--dtype", (served.dtype if served else None) or spec.dtype),
                ("--kv-cache-gib", spec.kv_cache_gib),
                ("--connector", spec.connector),
                ("--max-model-len", spec.max_model_len),
            ):
                if value is not None:
                    args += [flag, str(value)]
            path = served.path if served else spec.model
            if path:
                args += ["--model", path]
            if served:
                args += ["--served-model-name", served.name]
            if spec.block_size:
                args += ["--block-size", str(spec.block_size)]
            if tier_endpoint:
                args += ["--host-tier", tier_endpoint]
            if spec.peer_kv and role is Role.BOTH:
                args.append("--peer-kv")
            for extra in spec.extra_node_args:
                args += ["--engine-arg", extra]
            both_slot += role is Role.BOTH
            self._spawn(node_id, args, dict(spec.node_env))
        routers = spec.router_count
        if routers < 1:
            raise ConfigError("a cluster needs at least one router")
        for i in range(routers):
            self.add_router(
                spec.router_port, spec.policy, name="router" if i == 0 else f"router-{i}", reuse_port=routers > 1
            )
        # The slow path never takes CPU from the fast path: the writer runs SCHED_IDLE on any core
        # (every core belongs to an engine here), only where an engine would leave it idle.
        self._spawn(
            "lake-writer",
            [
                "telemetry",
                "consume",
                "--redis-url",
                self.redis_url,
                "--lake",
                str(self.lake),
                "--stream-prefix",
                key(self.name, "telemetry"),
                "--consumer",
                f"tandem-up-{spec.router_port}",
                "--cpu-priority",
                "idle",
            ],
        )

    def _start_host_tier(self) -> str:
        """Start the host tier for the nodes' block layout; returns its control endpoint."""
        spec = self.spec
        if spec.models:
            raise ConfigError("a host tier serves one model's layout: use it with a single --model")
        model = Path(spec.model) if spec.model else default_model_dir()
        sockets = runtime_dir(self.name)  # per cluster: two clusters in one workdir still get their own
        sockets.mkdir(parents=True, exist_ok=True)
        endpoint = f"ipc://{sockets / 'tier.sock'}"
        dtype = resolve_dtype(spec.dtype or "auto")
        layout = layout_from_model(model, dtype, spec.block_size or 128, os.environ.get("PYTHONHASHSEED"))
        self._tier_file = TierSettings(cluster=self.name).path_for(layout)
        args = ["tier", "serve", "--model", str(model), "--dtype", dtype, "--size"]
        # The engine's block size when none is set: vLLM's CPU platform picks 128 (a tier of another
        # layout is refused by the engine's connector at start, never silently missed).
        args += [str(spec.host_tier), "--block-size", str(spec.block_size or 128)]
        events = f"ipc://{sockets / 'tier-events.sock'}"
        replay = f"ipc://{sockets / 'tier-replay.sock'}"
        env = {
            "TANDEM_TIER_ENDPOINT": endpoint,
            "TANDEM_TIER_EVENTS_ENDPOINT": events,
            "TANDEM_TIER_REPLAY_ENDPOINT": replay,
            # its host_tier rows go where the router's records go, so the cluster's lake writer has them
            "TANDEM_TIER_TELEMETRY_REDIS_URL": self.redis_url,
            "TANDEM_TIER_TELEMETRY_STREAM_PREFIX": key(self.name, "telemetry"),
            **dict(spec.tier_env),
        }
        self._spawn("host-tier", args, env)
        return endpoint

    def add_router(
        self,
        port: int,
        policy: str | None,
        name: str | None = None,
        *,
        reuse_port: bool = False,
        env: dict[str, str] | None = None,
    ) -> str:
        """Start a router process over this cluster's registry (the cluster's own, or another replica
        with its own policy or ``TANDEM_ROUTER_*`` settings in ``env``, e.g. for a benchmark); returns its
        base URL. Every replica subscribes to the nodes' KV events itself. Stopped with the cluster."""
        args = ["router", "--port", str(port), "--redis-url", self.redis_url]
        if policy is not None:
            args += ["--policy", policy]
        if reuse_port:
            args.append("--reuse-port")
        name = name or f"router-{port}"
        child_env = {
            "TANDEM_SQLITE_PATH": str(self.spec.workdir / "tandem.db"),
            # Its own journal, kept across its restarts: a restarted replica sends what the dead one had not.
            "TANDEM_ROUTER_TELEMETRY_JOURNAL_DIR": str((self.spec.workdir / "journal" / name).resolve()),
            # Each replica loads and exercises the tokenizer before it listens: READY means every one is warm.
            "TANDEM_ROUTER_WARM_MODELS": json.dumps(self.spec.model_paths),
            **({"TANDEM_ROUTER_MODELS": str(self.spec.models_file.resolve())} if self.spec.models_file else {}),
            **dict(self.spec.router_env),
            **(env or {}),
        }
        self._spawn(name, args, child_env)
        return f"http://127.0.0.1:{port}"

    def live_node_ids(self) -> set[str]:
        client = redis.Redis.from_url(self.redis_url)
        try:
            ids = [m.decode() if isinstance(m, bytes) else m for m in client.smembers(nodes_set(self.name))]
            return {i for i in ids if client.exists(node_key(i, self.name))}
        finally:
            client.close()

    def dead_children(self) -> list[str]:
        return [f"{c.name} ({describe_exit(c.proc.returncode)})" for c in self.children if c.proc.poll() is not None]

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart children that exited, after their backoff; call it periodically from the thread that
        started the cluster (the parent-death signal follows that thread). Returns what happened, one
        line per event, for the caller to print; also writes the children's states to Redis."""
        now = time.monotonic() if now is None else now
        events: list[str] = []
        if now >= self._next_snapshot:
            self._snapshot_descendants()
            self._next_snapshot = now + 2.0
        for c in self.children:
            code = c.proc.poll()
            if code is None or c.gave_up:
                continue
            if c.restart_at is None:  # newly found dead
                c.last_exit = describe_exit(code)
                if c.is_node and code == EXIT_UNHEALTHY:
                    c.gave_up = True
                    events.append(
                        f"{c.name} gave up on its engine ({c.last_exit}): unhealthy, left down (logs in {self.logs})"
                    )
                    continue
                c.exits.append(now)
                while c.exits and now - c.exits[0] > CHILD_FAILURE_WINDOW_S:
                    c.exits.popleft()
                delay = min(CHILD_BACKOFF_MAX_S, CHILD_BACKOFF_S * 2 ** (len(c.exits) - 1))
                c.restart_at = now + delay
                events.append(f"{c.name} exited ({c.last_exit}); restarting in {delay:.0f} s")
            elif now >= c.restart_at:
                c.restart_at = None
                # What the dead child started got its parent-death signal; whatever has not exited by now
                # would hold the new child's ports (an engine still shutting down): kill it first.
                _kill_all(c.descendants)
                c.descendants = []
                try:
                    c.proc = c.start()
                except ConfigError as exc:  # an embedded Redis that would not come back: try again later
                    c.restart_at = now + CHILD_BACKOFF_MAX_S
                    events.append(f"{c.name} restart failed: {exc.message}")
                    continue
                c.restarts += 1
                events.append(f"RESTARTED {c.name} (pid {c.proc.pid}, restart {c.restarts})")
        self.publish_state()
        return events

    def _snapshot_descendants(self) -> None:
        """Remember what each live child has started (one pass over the process table for all children)."""
        kids: dict[int, list[psutil.Process]] = {}
        for p in psutil.process_iter(["ppid"]):
            kids.setdefault(p.info["ppid"], []).append(p)
        for c in self.children:
            if c.proc.poll() is not None:
                continue
            found, todo = [], [c.proc.pid]
            while todo:
                for p in kids.get(todo.pop(), []):
                    found.append(p)
                    todo.append(p.pid)
            c.descendants = found

    def publish_state(self) -> None:
        """The children's states in Redis for ``tandem cluster status``; best effort (Redis may be the
        child that is down)."""
        if self._state_client is None:
            self._state_client = redis.Redis.from_url(self.redis_url, socket_timeout=1, socket_connect_timeout=1)
        try:
            key = launcher_key(self.spec.router_port, self.name)
            with self._state_client.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                pipe.hset(key, mapping={c.name: json.dumps(c.state()) for c in self.children})
                pipe.expire(key, 3600)
                pipe.execute()
        except redis.RedisError:
            pass  # the next call reconnects

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
        routes = (["disaggregated"] if self.spec.prefill and self.spec.decode else []) + (
            ["colocated"] if self.spec.both else []
        )
        if not routes:  # no node to warm (a router and writer alone, or prefill-only)
            return
        cards = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        served = [c["id"] for c in cards if c.get("parent") is None]  # aliases resolve to these
        for model, route in ((m, r) for m in served for r in routes):
            resp = httpx.post(
                f"{url}/v1/chat/completions",
                timeout=self.spec.startup_timeout_s,
                headers={"x-tandem-route": route, "x-session-id": "tandem-warm-up"},
                json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            )
            if resp.status_code != 200:
                raise ConfigError(f"warm-up request ({route}) failed: {resp.status_code} {resp.text[:300]}")

    def _router_sees(self, want: set[str], url: str | None = None) -> bool:
        """The router's own view includes every node (its registry refresh has caught up)."""
        with contextlib.suppress(httpx.HTTPError, ValueError):
            nodes = httpx.get(f"{url or self.url}/health", timeout=1.0).json().get("nodes", {})
            return sum(nodes.values()) >= len(want)
        return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """Router first (no new work), then nodes (they deregister), then an embedded Redis; then any
        descendant still alive (an engine whose agent was SIGKILLed after its timeout) is killed."""
        order = sorted(self.procs, key=lambda np: (np[0] == "redis", not np[0].startswith("router")))
        descendants: list[psutil.Process] = []
        for _, proc in order:
            with contextlib.suppress(psutil.Error):
                descendants += psutil.Process(proc.pid).children(recursive=True)
        for name, proc in order:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            if name == "redis" or name.startswith("router"):
                _wait(proc, timeout_s)
        for _, proc in order:
            _wait(proc, timeout_s)
        _kill_all(descendants)
        self.children.clear()
        if self._tier_file is not None and not self.spec.keep_host_tier:
            with contextlib.suppress(FileNotFoundError):
                self._tier_file.unlink()
        with contextlib.suppress(redis.RedisError):  # an embedded Redis is gone already: nothing to clean
            client = self._state_client or redis.Redis.from_url(
                self.redis_url, socket_timeout=1, socket_connect_timeout=1
            )
            try:
                client.delete(launcher_key(self.spec.router_port, self.name))
            finally:
                client.close()
                self._state_client = None

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


def _kill_all(procs: list[psutil.Process], timeout_s: float = 10.0) -> None:
    """SIGKILL those of ``procs`` still alive (psutil checks a pid still is the process it was) and wait."""
    left: list[psutil.Process] = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
                left.append(p)
    psutil.wait_procs(left, timeout=timeout_s)


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
