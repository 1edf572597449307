"""The launcher's children: how each process of a cluster is started, kept up, recorded and stopped.

Children and their lifetimes
    Every child runs in its own session (one ``killpg`` reaches whatever it starts) and carries a
    parent-death signal (``node_agent.lifetime.die_with_parent``): if the launcher dies, even by SIGKILL,
    each child gets SIGTERM, and a node agent then stops its engine, whose own parent-death signal
    covers the agent's death. ``stop_children`` signals the routers first (no new work), then the nodes
    (they deregister), then an embedded Redis, waits for each, and finally SIGKILLs any descendant still
    alive, so nothing of the cluster outlives it or holds its ports.

Keeping them up (``restart_exited``, from ``Cluster.supervise``)
    A child that exits is started again with the same arguments after a backoff that doubles per
    exit in ``CHILD_FAILURE_WINDOW_S`` (1 s, 2 s, ... capped at ``CHILD_BACKOFF_MAX_S``); one dead
    child never stops the others. A node agent that exits with ``EXIT_UNHEALTHY`` gave up on its
    engine after its own restarts: it is left down and reported. Before a restart, whatever the dead
    child had started and is still alive (``snapshot_descendants`` keeps that list) is killed, so it
    cannot hold the new child's ports.

The launcher's record (``LauncherRecord``)
    The children's states, written to Redis (``tandem:launcher:<router port>``) after every supervision
    pass, which ``tandem cluster status`` shows; best effort, since Redis may be the child that is down.
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

import psutil
import redis

from contracts.cluster import CLUSTER_ENV, DEFAULT_CLUSTER, key
from contracts.errors import ConfigError
from node_agent.lifetime import die_with_parent
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


def spawn_tandem(name: str, args: list[str], *, logs: Path, cluster: str, env: dict[str, str] | None = None) -> Child:
    """Start ``python -m tandem ARGS`` as a child of cluster ``cluster``, its output appended to
    ``<logs>/<name>.log``; the returned child starts the same command again on a restart."""
    logs.mkdir(parents=True, exist_ok=True)

    def start() -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            return subprocess.Popen(
                [sys.executable, "-m", "tandem", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, CLUSTER_ENV: cluster, **(env or {})},
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )

    return Child(name, start, start(), is_node=args[0] == "node")


def dead_children(children: list[Child]) -> list[str]:
    """``name (how it exited)`` of every child not running now."""
    return [f"{c.name} ({describe_exit(c.proc.returncode)})" for c in children if c.proc.poll() is not None]


def restart_exited(children: list[Child], now: float, logs: Path) -> list[str]:
    """One supervision pass: note each newly exited child and schedule its restart after its backoff (a
    node agent that gave up on its engine is left down), restart those whose backoff is over. Returns
    what happened, one line per event."""
    events: list[str] = []
    for c in children:
        code = c.proc.poll()
        if code is None or c.gave_up:
            continue
        if c.restart_at is None:  # newly found dead
            c.last_exit = describe_exit(code)
            if c.is_node and code == EXIT_UNHEALTHY:
                c.gave_up = True
                events.append(f"{c.name} gave up on its engine ({c.last_exit}): unhealthy, left down (logs in {logs})")
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
            kill_all(c.descendants)
            c.descendants = []
            try:
                c.proc = c.start()
            except ConfigError as exc:  # an embedded Redis that would not come back: try again later
                c.restart_at = now + CHILD_BACKOFF_MAX_S
                events.append(f"{c.name} restart failed: {exc.message}")
                continue
            c.restarts += 1
            events.append(f"RESTARTED {c.name} (pid {c.proc.pid}, restart {c.restarts})")
    return events


def snapshot_descendants(children: list[Child]) -> None:
    """Remember what each live child has started (one pass over the process table for all children)."""
    kids: dict[int, list[psutil.Process]] = {}
    for p in psutil.process_iter(["ppid"]):
        kids.setdefault(p.info["ppid"], []).append(p)
    for c in children:
        if c.proc.poll() is not None:
            continue
        found, todo = [], [c.proc.pid]
        while todo:
            for p in kids.get(todo.pop(), []):
                found.append(p)
                todo.append(p.pid)
        c.descendants = found


class LauncherRecord:
    """The children's states in Redis (``launcher_key``) for ``tandem cluster status``."""

    def __init__(self, redis_url: str, record_key: str) -> None:
        self.key = record_key
        self._client = redis.Redis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1)

    def publish(self, children: list[Child]) -> None:
        """Replace the record with the children's states now; best effort (Redis may be the child that
        is down)."""
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self.key)
                pipe.hset(self.key, mapping={c.name: json.dumps(c.state()) for c in children})
                pipe.expire(self.key, 3600)
                pipe.execute()
        except redis.RedisError:
            pass  # the next call reconnects

    def delete(self) -> None:
        """Remove the record (a clean stop) and close the client."""
        with contextlib.suppress(redis.RedisError):  # an embedded Redis is gone already: nothing to clean
            try:
                self._client.delete(self.key)
            finally:
                self._client.close()


def stop_children(children: list[Child], timeout_s: float) -> None:
    """Routers first (no new work), then nodes (they deregister), then an embedded Redis; then any
    descendant still alive (an engine whose agent was SIGKILLed after its timeout) is killed."""
    order = sorted(
        ((c.name, c.proc) for c in children), key=lambda np: (np[0] == "redis", not np[0].startswith("router"))
    )
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
    kill_all(descendants)


def kill_all(procs: list[psutil.Process], timeout_s: float = 10.0) -> None:
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
