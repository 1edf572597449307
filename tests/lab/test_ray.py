"""Ray places a Tandem cluster on the lab's hosts and restarts a killed node (issue 38, item 5).

A Ray cluster whose machines are lab hosts: ``ray start --head`` in the router host, ``ray start
--address`` in the store and node hosts, each with its host's custom resource and token authentication
(``infra.ray_deploy``). A driver run inside the router host places Redis on the store host, then the
router and a ``--role both`` node, each a detached ``ProcessOwner`` actor pinned to its host and restarted
without limit. The secrets (cluster secret, Redis password, Ray's token) are in each host's environment
at ``ray start``, never in an actor's arguments. Every request comes from a client host with no Ray.

- The cluster answers a chat request through the router, from the client host; Ray sees one machine
  per Ray host, each with its host's resource, and the node agent is its actor's child.
- A driver with a wrong Ray token is refused, from the client host.
- The node's actor process SIGKILLed: its node agent and engine die with it (``PR_SET_PDEATHSIG``), Ray
  starts a new actor in the node host, which starts a new node; it registers under a new epoch and the
  router answers again.
- The node agent itself SIGKILLed: its owner ends its actor, Ray restarts it, and again a new node
  registers and the router answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
import redis

from contracts.registry import NodeInfo, node_key
from infra.lab import Lab, LabSpec
from infra.ray_deploy import GCS_PORT, Placement, ray_start_argv
from tests.support.helpers import alive_pids, wait_for

pytestmark = pytest.mark.e2e

SPEC = LabSpec("ray", {"router": 0, "store": 0, "node": 0, "client": 0}, net=235)
RAY_HOSTS = ("router", "store", "node")
"""The Ray cluster's machines, head first; the client host runs no Ray."""
NODE_ID = "node-8100"
NODE_PORT = 8100
ROUTER_PORT = 8000
REDIS_PORT = 6379
RESTART_TIMEOUT_S = 240.0
"""A new actor, a new node agent, a new engine on a 2-core host shared with six Ray processes."""


@dataclass
class RayLab:
    lab: Lab
    workdir: Path
    ray_dir: Path
    secret: str = field(default_factory=lambda: secrets.token_hex(32))
    store_password: str = field(default_factory=lambda: secrets.token_hex(16))
    ray_token: str = field(default_factory=lambda: secrets.token_hex(32))

    @property
    def head(self) -> str:
        return f"{self.lab.address('router')}:{GCS_PORT}"

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.store_password}@{self.lab.address('store')}:{REDIS_PORT}/0"

    @property
    def router_url(self) -> str:
        return f"http://{self.lab.address('router')}:{ROUTER_PORT}"

    def host_env(self, host: str) -> dict[str, str]:
        """A machine's environment at ``ray start``: what every process Ray starts there inherits."""
        tmp = self.workdir / "hosts" / host
        tmp.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "RAY_"))}
        return {
            **env,
            "TMPDIR": str(tmp),
            "TANDEM_CLUSTER_SECRET": self.secret,
            "TANDEM_REDIS_URL": self.redis_url,
            "REDIS_PASSWORD": self.store_password,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.ray_token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
        }

    def start_ray(self) -> None:
        for host in RAY_HOSTS:
            head = None if host == "router" else self.lab.address("router")
            argv = ray_start_argv(host, self.lab.address(host), head=head, temp_dir=self.ray_dir / host)
            done = subprocess.run(
                self.lab.command(host, argv), env=self.host_env(host), capture_output=True, text=True, timeout=180
            )
            assert done.returncode == 0, f"ray start in {host}: {done.stderr[-2000:]}"

    def plan(self) -> list[Placement]:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        store = self.lab.address("store")
        redis_argv = ["redis-server", "--bind", store, "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no"]
        node = [sys.executable, "-m", "tandem", "node", "--role", "both", "--port", str(NODE_PORT)]
        node += ["--node-id", NODE_ID, "--cores", "1", "--log-dir", str(logs / "engine")]
        router = [sys.executable, "-m", "tandem", "router", "--host", self.lab.address("router")]
        # Redis's password from the store host's environment, not the plan (which Ray's GCS keeps and shows).
        redis_cmd = f'exec {" ".join(redis_argv)} --requirepass "$REDIS_PASSWORD"'
        return [
            Placement("redis", "store", ["sh", "-c", redis_cmd], log=str(logs / "redis.log")),
            Placement("router", "router", [*router, "--port", str(ROUTER_PORT)], log=str(logs / "router.log")),
            Placement(
                "node", "node", node, env={"TANDEM_NODE_HOST": self.lab.address("node")}, log=str(logs / "node.log")
            ),
        ]

    def driver(self, action: str, plan: list[Placement]) -> str:
        """``python -m infra.ray_deploy`` in the head's host, as an operator would run it there."""
        path = self.workdir / f"plan-{action}-{len(plan)}.json"
        path.write_text(json.dumps([asdict(p) for p in plan]))
        argv = [sys.executable, "-m", "infra.ray_deploy", action, str(path), "--address", self.head]
        done = subprocess.run(
            self.lab.command("router", argv), env=self.host_env("router"), capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"ray_deploy {action}: {done.stdout[-1000:]}{done.stderr[-3000:]}"
        return done.stdout

    # -- what the test observes, from outside Ray -------------------------------------------------------
    def host_processes(self, host: str) -> list[psutil.Process]:
        out = []
        for pid in self.lab.run(host, ["ip", "netns", "pids", self.lab.hosts[host].namespace]).stdout.split():
            with contextlib.suppress(psutil.NoSuchProcess, ValueError):
                out.append(psutil.Process(int(pid)))
        return out

    def node_processes(self) -> tuple[int | None, int | None]:
        """(the node actor's worker process, the node agent it owns) in the node host, as ``ps`` sees them."""
        owner = agent = None
        for proc in self.host_processes("node"):
            with contextlib.suppress(psutil.NoSuchProcess):
                if proc.name().startswith("ray::ProcessOwner") or "ray::ProcessOwner" in " ".join(proc.cmdline()):
                    owner = proc.pid
                elif proc.cmdline()[1:5] == ["-m", "tandem", "node", "--role"]:
                    agent = proc.pid
        return owner, agent

    def node_epoch(self) -> int | None:
        with self.lab.inside("client"):
            client = redis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)
            try:
                raw = client.get(node_key(NODE_ID))
            except redis.RedisError:
                return None
            finally:
                client.close()
        return msgspec.msgpack.decode(raw, type=NodeInfo).epoch if raw else None

    def answers(self) -> bool:
        """The router, from the client host, sees a node and answers a chat request."""
        with self.lab.inside("client"), httpx.Client(timeout=120) as http:
            try:
                if sum(http.get(f"{self.router_url}/health").json().get("nodes", {}).values()) < 1:
                    return False
                model = http.get(f"{self.router_url}/v1/models").json()["data"][0]["id"]
                resp = http.post(
                    f"{self.router_url}/v1/chat/completions",
                    json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                )
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                return False
        return resp.status_code == 200 and bool(resp.json()["choices"][0]["message"]["content"])

    def redis_up(self) -> bool:
        with self.lab.inside("client"):
            client = redis.Redis.from_url(self.redis_url, socket_timeout=1, socket_connect_timeout=1)
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False
            finally:
                client.close()

    def print_logs(self) -> None:
        for log in sorted((self.workdir / "logs").glob("*.log")):
            tail = "".join(log.read_text(errors="replace").splitlines(True)[-15:])
            print(f"--- {log.name}\n{tail}")


@pytest.fixture(scope="module")
def rl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayLab]:
    # Ray's sockets live under its temp dir, and a Unix socket path has at most 107 bytes: a short root.
    ray_dir = Path(tempfile.mkdtemp(prefix="tr235-"))
    with Lab(SPEC) as lab:
        rl = RayLab(lab, tmp_path_factory.mktemp("ray"), ray_dir)
        plan = rl.plan()
        try:
            rl.start_ray()
            rl.driver("up", plan[:1])  # the store first: the router and the node register in it
            assert wait_for(rl.redis_up, 60), "Redis placed by Ray did not answer"
            rl.driver("up", plan)  # Redis's actor exists already and is kept
            assert wait_for(rl.answers, 600, interval_s=1.0), "the cluster placed by Ray never answered"
            yield rl
        finally:
            # The plan in reverse (node, router, Redis). No `ray stop`: it stops every Ray process of the
            # machine, whatever its namespace; the lab's `down` kills the Ray processes left in its hosts.
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                rl.driver("down", plan)
            rl.print_logs()
    shutil.rmtree(ray_dir, ignore_errors=True)


def _restarted(rl: RayLab, owner: int, agent: int, epoch: int, killed_at: float) -> None:
    """After a kill: the old agent (and so its engine) is gone, a new actor owns a new agent, the node
    registers under a new epoch and the router answers through it."""
    assert wait_for(lambda: not alive_pids({agent}), 60), "the old node agent outlived its owner"
    assert wait_for(
        lambda: all(rl.node_processes()) and rl.node_processes() != (owner, agent), RESTART_TIMEOUT_S, 0.2
    ), f"Ray started no new node actor and agent (node host: {rl.node_processes()})"
    new_owner, new_agent = rl.node_processes()
    assert new_owner is not None and new_agent is not None
    assert new_owner != owner and new_agent != agent and psutil.Process(new_agent).ppid() == new_owner
    respawned = time.monotonic() - killed_at
    assert wait_for(lambda: (rl.node_epoch() or 0) > epoch, RESTART_TIMEOUT_S, 0.5), "no new registration"
    assert wait_for(rl.answers, RESTART_TIMEOUT_S, 1.0), "the router did not answer through the restarted node"
    print(f"new actor and agent {respawned:.1f} s, answering {time.monotonic() - killed_at:.1f} s after the kill")


def test_ray_places_the_cluster_on_the_lab_hosts(rl: RayLab) -> None:
    nodes = subprocess.run(
        rl.lab.command("router", [sys.executable, "-c", _LIST_NODES, rl.head]),
        env=rl.host_env("router"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert nodes.returncode == 0, nodes.stderr[-2000:]
    seen = json.loads(nodes.stdout.strip().splitlines()[-1])
    assert seen == {rl.lab.address(h): f"tandem_host_{h}" for h in RAY_HOSTS}
    owner, agent = rl.node_processes()
    assert owner is not None and agent is not None, "no node actor or agent in the node host"
    assert psutil.Process(agent).ppid() == owner, "the node agent is not the node actor's child"
    assert rl.answers()


def test_a_driver_with_a_wrong_ray_token_is_refused(rl: RayLab) -> None:
    """Ray's port runs whatever a driver sends it: from the client host, a driver with a wrong token is
    refused by the head (the same driver with the token, on a Ray host, is the first test's: a driver
    runs where a Ray node does)."""
    env = {**rl.host_env("client"), "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    done = subprocess.run(
        rl.lab.command("client", [sys.executable, "-c", _LIST_NODES, rl.head]),
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode != 0 and not done.stdout.strip(), done.stdout[-500:]
    assert "ray.exceptions.AuthenticationError" in done.stderr, done.stderr[-1500:]


def test_a_killed_node_actor_is_restarted_by_ray(rl: RayLab) -> None:
    owner, agent = rl.node_processes()
    epoch = rl.node_epoch()
    assert owner is not None and agent is not None and epoch is not None
    os.kill(owner, signal.SIGKILL)
    _restarted(rl, owner, agent, epoch, time.monotonic())


def test_a_killed_node_process_ends_its_actor_and_ray_restarts_it(rl: RayLab) -> None:
    owner, agent = rl.node_processes()
    epoch = rl.node_epoch()
    assert owner is not None and agent is not None and epoch is not None
    os.kill(agent, signal.SIGKILL)
    killed_at = time.monotonic()
    assert wait_for(lambda: not alive_pids({owner}), 60), "the owner outlived the process it owns"
    _restarted(rl, owner, agent, epoch, killed_at)


_LIST_NODES = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps({n["NodeManagerAddress"]: next(r for r in n["Resources"] if r.startswith("tandem_host_"))
                  for n in ray.nodes() if n["Alive"]}))
"""
