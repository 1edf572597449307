"""``tandem up``: a whole cluster on this machine (Redis if needed, N prefill, M decode, K colocated
nodes, router replicas sharing one port, the lake writer) as child processes, kept up, stopped
together on Ctrl-C / SIGTERM.

Also the fixture behind the end-to-end tests and benchmarks, which need the same real processes.

``Cluster`` is the one object its users hold; what it does is split by concern:

- ``infra.cluster_spec``: what the cluster is made of (``ClusterSpec``, ``ModelSpec``);
- ``infra.cores``: which cores each node computes on, how many router replicas a host runs;
- ``infra.children``: each process's lifetime (own session, parent-death signal), its restarts with
  backoff (``supervise``, called by ``tandem up`` once the cluster is ready), the launcher's record in
  Redis that ``tandem cluster status`` shows, and the ordered stop;
- ``infra.readiness``: the waits until the cluster serves (``wait_ready``, ``wait_router``) and the
  warm-up requests;
- here: ``start`` as its steps, in the order the children need each other (Redis, the host tier, the
  nodes, the routers, the lake writer), and each child's command line.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from contracts.cluster import DEFAULT_CLUSTER, key, runtime_dir, validate
from contracts.config import redis_url as configured_redis_url
from contracts.config import shared_settings
from contracts.errors import ConfigError
from contracts.registry import Role
from host_tier.settings import TierSettings, layout_from_model
from infra import readiness
from infra.children import (
    Child,
    LauncherRecord,
    dead_children,
    launcher_key,
    restart_exited,
    snapshot_descendants,
    spawn_tandem,
    stop_children,
)
from infra.cluster_spec import ClusterSpec, ModelSpec, models_from_file, parse_model_option
from infra.cores import assign_cores
from infra.redis_server import reachable, start_embedded
from node_agent.dtype import resolve_dtype
from node_agent.model import default_model_dir

__all__ = [
    "Child",
    "Cluster",
    "ClusterSpec",
    "ModelSpec",
    "assign_cores",
    "launcher_key",
    "models_from_file",
    "parse_model_option",
]


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
        self._record: LauncherRecord | None = None
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
        self.children.append(spawn_tandem(name, args, logs=self.logs, cluster=self.name, env=env))

    def start(self) -> None:
        """Start every child, each step's children before those that need them."""
        self._start_redis()
        tier_endpoint = self._start_host_tier() if self.spec.host_tier else None
        self._start_nodes(tier_endpoint)
        self._start_routers()
        self._start_lake_writer()

    def _start_redis(self) -> None:
        """An embedded Redis when asked for, or when none is configured and the default does not answer."""
        spec = self.spec
        if spec.embedded_redis or (spec.redis_url is None and not reachable(self.redis_url)):
            self.redis_url = f"redis://127.0.0.1:{spec.redis_port}/0"

            def start_redis() -> subprocess.Popen[bytes]:
                return start_embedded(spec.redis_port, spec.workdir / "redis")

            self.children.append(Child("redis", start_redis, start_redis()))
        elif not reachable(self.redis_url):
            raise ConfigError(f"Redis at {self.redis_url} does not answer")

    def _start_nodes(self, tier_endpoint: str | None) -> None:
        """Node i listens on ``node_base_port + 10*i`` as ``<role>-<i>-<port>``, on the cores
        ``assign_cores`` gives its role (colocated nodes each take their slot of them)."""
        spec = self.spec
        has_pd = spec.prefill > 0 and spec.decode > 0
        nodes = spec.nodes
        both_slot, both_slots = 0, sum(role is Role.BOTH for role, _ in nodes)
        for i, (role, served) in enumerate(nodes):
            port = spec.node_base_port + 10 * i
            node_id = f"{role.value}-{i}-{port}"
            self.node_urls[node_id] = f"http://127.0.0.1:{port}"
            self.node_ids[node_id] = role
            cores = assign_cores(role, has_pd, both_slot, both_slots)
            both_slot += role is Role.BOTH
            self._spawn(
                node_id, self._node_args(role, served, port, node_id, cores, tier_endpoint), dict(spec.node_env)
            )

    def _node_args(
        self, role: Role, served: ModelSpec | None, port: int, node_id: str, cores: str, tier_endpoint: str | None
    ) -> list[str]:
        """``tandem node ...`` for one node; an engine setting the spec leaves unset is left to the node."""
        spec = self.spec
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
            cores,
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
        return args

    def _start_routers(self) -> None:
        """The router replicas, all on the router port (SO_REUSEPORT when there are several)."""
        spec = self.spec
        routers = spec.router_count
        if routers < 1:
            raise ConfigError("a cluster needs at least one router")
        for i in range(routers):
            self.add_router(
                spec.router_port, spec.policy, name="router" if i == 0 else f"router-{i}", reuse_port=routers > 1
            )

    def _start_lake_writer(self) -> None:
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
                f"tandem-up-{self.spec.router_port}",
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
        layout = layout_from_model(model, dtype, spec.block_size or 128, shared_settings().hash_seed)
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
        return readiness.live_node_ids(self.redis_url, self.name)

    def dead_children(self) -> list[str]:
        return dead_children(self.children)

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart children that exited, after their backoff (``infra.children.restart_exited``); call it
        periodically from the thread that started the cluster (the parent-death signal follows that
        thread). Returns what happened, one line per event, for the caller to print; also writes the
        children's states to Redis."""
        now = time.monotonic() if now is None else now
        if now >= self._next_snapshot:
            snapshot_descendants(self.children)
            self._next_snapshot = now + 2.0
        events = restart_exited(self.children, now, self.logs)
        self.publish_state()
        return events

    def publish_state(self) -> None:
        """The children's states in Redis for ``tandem cluster status``; best effort (Redis may be the
        child that is down)."""
        if self._record is None:
            self._record = LauncherRecord(self.redis_url, launcher_key(self.spec.router_port, self.name))
        self._record.publish(self.children)

    def wait_ready(self, on_progress: Callable[[str], None] | None = None) -> None:
        readiness.wait_ready(self, on_progress)

    def wait_router(self, url: str, timeout_s: float = 120.0) -> None:
        """Wait until a router started with ``add_router`` sees every node, then warm it up."""
        readiness.wait_router(self, url, timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Every child (``infra.children.stop_children``: routers, nodes, an embedded Redis, then any
        descendant still alive), the host tier's file unless kept, and the launcher's record."""
        stop_children(self.children, timeout_s)
        self.children.clear()
        if self._tier_file is not None and not self.spec.keep_host_tier:
            with contextlib.suppress(FileNotFoundError):
                self._tier_file.unlink()
        record = self._record or LauncherRecord(self.redis_url, launcher_key(self.spec.router_port, self.name))
        record.delete()
        self._record = None

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
