"""When a started cluster is ready: every node registered (a live key in Redis), each router up and
seeing every node through its own registry refresh, and one tiny request down each path (``warm_up``),
so the first user request pays no one-off cost.

The children have no readiness callback, so this polls: the registry and the routers' ``/health``,
once a second (a router started later, every half second). During start-up a dead child is fatal:
that is a configuration problem (a taken port, a missing model), not a crash to ride out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import httpx
import redis

from contracts.errors import ConfigError
from contracts.registry import Role, node_key, nodes_set
from infra.cluster_spec import ClusterSpec


class Starting(Protocol):
    """What the waits read of a cluster being started (``infra.launcher.Cluster``)."""

    spec: ClusterSpec
    name: str
    redis_url: str
    node_ids: dict[str, Role]
    logs: Path

    @property
    def url(self) -> str: ...

    def dead_children(self) -> list[str]: ...


def live_node_ids(redis_url: str, cluster: str) -> set[str]:
    """The nodes registered in cluster ``cluster`` whose registry key is alive."""
    client = redis.Redis.from_url(redis_url)
    try:
        ids = [m.decode() if isinstance(m, bytes) else m for m in client.smembers(nodes_set(cluster))]
        return {i for i in ids if client.exists(node_key(i, cluster))}
    finally:
        client.close()


def wait_ready(cluster: Starting, on_progress: Callable[[str], None] | None = None) -> None:
    """Wait until every node is registered and the cluster's router sees them all, then warm it up."""
    deadline = time.monotonic() + cluster.spec.startup_timeout_s
    want = set(cluster.node_ids)
    while time.monotonic() < deadline:
        dead = cluster.dead_children()
        if dead:
            raise ConfigError(f"cluster process died during start-up: {', '.join(dead)}; logs in {cluster.logs}")
        live = live_node_ids(cluster.redis_url, cluster.name) & want
        router_ok = False
        with contextlib.suppress(httpx.HTTPError):
            router_ok = httpx.get(f"{cluster.url}/health", timeout=1.0).status_code == 200
        if on_progress:
            on_progress(f"nodes ready {len(live)}/{len(want)}, router {'up' if router_ok else 'starting'}")
        if live == want and router_ok and router_sees(cluster.url, want):
            warm_up(cluster.spec, cluster.url)
            return
        time.sleep(1.0)  # polling child processes that have no readiness callback
    raise ConfigError(f"cluster not ready after {cluster.spec.startup_timeout_s:.0f} s; logs in {cluster.logs}")


def wait_router(cluster: Starting, url: str, timeout_s: float) -> None:
    """Wait until a router started with ``Cluster.add_router`` sees every node, then warm it up."""
    deadline = time.monotonic() + timeout_s
    while not router_sees(url, set(cluster.node_ids)):
        dead = cluster.dead_children()
        if dead or time.monotonic() > deadline:
            raise ConfigError(f"router at {url} not ready ({', '.join(dead) or 'timeout'}); logs in {cluster.logs}")
        time.sleep(0.5)  # polling a child process that has no readiness callback
    warm_up(cluster.spec, url)


def warm_up(spec: ClusterSpec, url: str) -> None:
    """One tiny request down each path before saying READY, so the first user request does not pay
    one-off costs (the router loading the tokenizer, the first NIXL handshake between P and D)."""
    routes = (["disaggregated"] if spec.prefill and spec.decode else []) + (["colocated"] if spec.both else [])
    if not routes:  # no node to warm (a router and writer alone, or prefill-only)
        return
    cards = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    served = [c["id"] for c in cards if c.get("parent") is None]  # aliases resolve to these
    for model, route in ((m, r) for m in served for r in routes):
        resp = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=spec.startup_timeout_s,
            headers={"x-tandem-route": route, "x-session-id": "tandem-warm-up"},
            json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        )
        if resp.status_code != 200:
            raise ConfigError(f"warm-up request ({route}) failed: {resp.status_code} {resp.text[:300]}")


def router_sees(url: str, want: set[str]) -> bool:
    """The router's own view includes every node (its registry refresh has caught up)."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        nodes = httpx.get(f"{url}/health", timeout=1.0).json().get("nodes", {})
        return sum(nodes.values()) >= len(want)
    return False
