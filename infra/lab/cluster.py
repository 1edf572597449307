"""A Tandem cluster spread over the hosts of a ``tandem lab`` (``infra.lab``), one component per host, each
bound to and registered at its host's own address: what the lab tests run on.

    router   10.<net>.0.10   tandem router (the only port a client needs)
    prefill  10.<net>.0.11   tandem node --role prefill   (engine, block server, KV-event relay)
    decode   10.<net>.0.12   tandem node --role decode
    colo     10.<net>.0.13   tandem node --role both      (the colocated arm P/D is compared with)
    store    10.<net>.0.14   Redis (registry, keys, telemetry) and PostgreSQL (the router's key and session store)
    client   10.<net>.0.15   no process: the test's client, and the outsider that holds no credential

With ``lake=True`` the store host also runs a lake writer (``tandem telemetry consume``) into
``<workdir>/lake``: the router's telemetry then goes router -> Redis Stream -> Parquet across hosts, and a
fault test counts the lake's rows against the requests it sent (``lake_response_ids``). Each lab gets its
own ``LabSpec`` (name and net), so several labs run side by side; ``lose_host`` SIGKILLs every process
of a host at once (a machine lost), ``start_node`` starts a lost node again.

Redis and PostgreSQL run inside the lab, on a host of their own, not the machine's shared servers: the lab
gives the machine's namespace no address (``infra.lab.network``), so those are unreachable from the hosts
by design, and a store on its own host is what a partition test can cut. Both demand a password, so the
client host, holding none, reads no registry entry and no key; the cluster's processes get the URLs with
the password in their environment (``TANDEM_REDIS_URL``, ``TANDEM_DATABASE_URL``), never on a command line
that ``ps`` shows.

Each host also gets its own ``TMPDIR``: the cluster's ipc sockets and runtime files
(``contracts.cluster.runtime_dir``) are then per host, as on separate machines, and no process can reach
another host's block server through a Unix socket on the shared file system. Every process of the
cluster holds the one cluster secret (``TANDEM_CLUSTER_SECRET``), which a node on a real interface
refuses to start without.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from contracts.registry import node_key
from contracts.secret import engine_api_key
from infra.lab.network import Lab, LabSpec
from node_agent.engine_metrics import parse_metrics
from node_agent.lifetime import die_with_parent

SPEC = LabSpec("pd", {"router": 0, "prefill": 0, "decode": 0, "colo": 0, "store": 0, "client": 0}, net=232)
NODES = {"prefill": ("prefill", "0"), "decode": ("decode", "1"), "colo": ("both", "1")}
"""Lab host -> (role, cores). P and D on disjoint cores; the colocated node shares decode's, as ``tandem up``
places a colocated node beside a P/D pair (``infra.launcher.assign_cores``)."""
NODE_PORT = 8100
ROUTER_PORT = 8000
REDIS_PORT = 6379
PG_PORT = 5432
PG_BIN = Path("/usr/lib/postgresql/15/bin")
START_TIMEOUT_S = 900.0


@dataclass
class LabCluster:
    lab: Lab
    workdir: Path
    secret: str = field(default_factory=lambda: secrets.token_hex(32))
    store_password: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    model: str = ""
    lake: Path | None = None
    """The lake writer's Parquet folder (``lake_cluster(..., lake=True)``); None: no lake writer."""
    _pg_dir: Path | None = None

    # -- addresses ------------------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        return f"redis://:{self.store_password}@{self.lab.address('store')}:{REDIS_PORT}/0"

    @property
    def pg_url(self) -> str:
        return f"postgresql://postgres:{self.store_password}@{self.lab.address('store')}:{PG_PORT}/postgres"

    @property
    def router_url(self) -> str:
        return f"http://{self.lab.address('router')}:{ROUTER_PORT}"

    def engine_url(self, host: str) -> str:
        return f"http://{self.lab.address(host)}:{NODE_PORT}"

    def block_server(self, host: str) -> str:
        return f"tcp://{self.lab.address(host)}:{NODE_PORT + 3}"

    def relay(self, host: str) -> tuple[str, str]:
        """A node's KV-event relay: (events, replay)."""
        address = self.lab.address(host)
        return f"tcp://{address}:{NODE_PORT + 1}", f"tcp://{address}:{NODE_PORT + 2}"

    @property
    def engine_headers(self) -> dict[str, str]:
        """What a member of the cluster (a router, a node agent) sends an engine."""
        return {"Authorization": f"Bearer {engine_api_key(self.secret.encode())}"}

    # -- processes ------------------------------------------------------------------------------------
    def _env(self, host: str) -> dict[str, str]:
        tmp = self.workdir / "hosts" / host
        tmp.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        return {
            **env,
            "TMPDIR": str(tmp),
            "TANDEM_CLUSTER_SECRET": self.secret,
            "TANDEM_REDIS_URL": self.redis_url,
            "PYTHONUNBUFFERED": "1",
        }

    def _spawn(self, name: str, host: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "ab") as log:
            self.procs[name] = self.lab.popen(
                host,
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # one killpg reaches a node's engine too
                preexec_fn=die_with_parent(),  # pytest killed: the lab's processes follow
            )

    def start_store(self) -> None:
        address = self.lab.address("store")
        self._spawn(
            "redis",
            "store",
            ["redis-server", "--bind", address, "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no"]
            + ["--requirepass", self.store_password],
        )
        # PostgreSQL will not run as root: its data folder belongs to the postgres user, outside pytest's
        # root-only temporary tree.
        self._pg_dir = Path(tempfile.mkdtemp(prefix="tandem-lab-pg-"))
        data = self._pg_dir / "data"
        password = self._pg_dir / "pw"
        password.write_text(self.store_password + "\n")
        shutil.chown(self._pg_dir, "postgres", "postgres")
        shutil.chown(password, "postgres", "postgres")
        as_postgres = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
        subprocess.run(
            [*as_postgres, str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", f"--pwfile={password}"]
            + ["--auth-host=scram-sha-256", "--auth-local=peer", "--no-sync"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {self.lab.subnet(0)} scram-sha-256\n")
        self._spawn(
            "postgres",
            "store",
            [*as_postgres, str(PG_BIN / "postgres"), "-D", str(data), "-p", str(PG_PORT)]
            + ["-c", f"listen_addresses={address}", "-c", f"unix_socket_directories={self._pg_dir}"]
            + ["-c", "fsync=off", "-c", "max_connections=50"],
        )
        deadline = time.monotonic() + 60
        with self.lab.inside("client"):
            client = redis.Redis.from_url(self.redis_url, socket_timeout=1, socket_connect_timeout=1)
            try:
                while not self._answers(client, deadline):
                    time.sleep(0.2)  # polling servers that have no readiness callback
            finally:
                client.close()
        ready = [str(PG_BIN / "pg_isready"), "-q", "-h", address, "-p", str(PG_PORT)]
        while self.lab.run("store", ready, timeout=10).returncode != 0:
            if self.dead() or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL in the lab did not start: {', '.join(self.dead()) or 'timeout'}")
            time.sleep(0.2)

    def _answers(self, client: redis.Redis, deadline: float) -> bool:
        if self.dead() or time.monotonic() > deadline:
            raise RuntimeError(f"Redis in the lab did not start: {', '.join(self.dead()) or 'timeout'}")
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    def start_nodes(self) -> None:
        for host in NODES:
            self.start_node(host)

    def start_node(self, host: str) -> None:
        """The node of ``host`` (again, after ``lose_host``: same id, same address, a new epoch)."""
        role, cores = NODES[host]
        argv = [sys.executable, "-m", "tandem", "node", "--role", role, "--port", str(NODE_PORT)]
        argv += ["--node-id", node_id(host), "--dtype", "float32"]
        argv += ["--cores", cores, "--log-dir", str(self.workdir / "logs" / host)]
        self._spawn(host, host, argv, {**self._env(host), "TANDEM_NODE_HOST": self.lab.address(host)})

    def start_lake_writer(self) -> None:
        """A lake writer on the store host, beside the Redis it drains (the router's telemetry streams)."""
        self.lake = self.workdir / "lake"
        self.lake.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "tandem", "telemetry", "consume", "--lake", str(self.lake)]
        argv += ["--consumer", "lab-store", "--block-ms", "200"]
        self._spawn("lake-writer", "store", argv, self._env("store"))

    def lose_host(self, host: str) -> list[int]:
        """Every process in ``host``'s namespace SIGKILLed at once, as when a machine dies: no process gets to
        deregister, close a socket politely or flush anything. Returns the pids killed."""
        pids = _netns_pids(self.lab.hosts[host].namespace)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs.values():
            if proc.pid in pids:
                proc.wait(30)  # reaped: the host's processes are gone when this returns
        return pids

    def registered(self) -> set[str]:
        """Node ids with a registry entry in the lab's Redis (read from the client host, with the password)."""
        with self.lab.inside("client"):
            client = redis.Redis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=5)
            try:
                prefix = node_key("")
                return {k.decode().removeprefix(prefix) for k in client.scan_iter(node_key("*"))}
            finally:
                client.close()

    def router_nodes(self, http: httpx.Client) -> int:
        """Nodes the router's ``/health`` counts (call from the client host)."""
        return int(sum(http.get(f"{self.router_url}/health").json().get("nodes", {}).values()))

    def kv_held(self, host: str, http: httpx.Client) -> tuple[int, int]:
        """(active leases, leased blocks) on ``host``'s block server, from its engine's ``/metrics``."""
        text = http.get(f"{self.engine_url(host)}/metrics").text
        return int(_sum_metric(text, "tandem_kv_leases_active")), int(_sum_metric(text, "tandem_kv_leased_blocks"))

    def busy(self, host: str, http: httpx.Client) -> int:
        """Requests running or waiting in ``host``'s engine."""
        snap = parse_metrics(http.get(f"{self.engine_url(host)}/metrics").text)
        return int(snap.running + snap.waiting)

    def lake_response_ids(self) -> set[str]:
        """Response ids in the lake's ``requests`` table (an empty set before the first part is written)."""
        import duckdb

        from telemetry.query import query

        if self.lake is None:
            raise RuntimeError("this lab cluster runs no lake writer (lab_cluster(..., lake=True))")
        try:
            return set(query(self.lake, "SELECT DISTINCT response_id FROM requests").column(0).to_pylist())
        except (duckdb.Error, OSError):  # no part yet, or a part renamed under the query
            return set()

    def start_router(self) -> None:
        argv = [sys.executable, "-m", "tandem", "router", "--host", self.lab.address("router")]
        argv += ["--port", str(ROUTER_PORT)]
        env = {
            **self._env("router"),
            "TANDEM_DATABASE_URL": self.pg_url,
            "TANDEM_ROUTER_TELEMETRY_JOURNAL_DIR": str(self.workdir / "journal"),
        }
        self._spawn("router", "router", argv, env)

    def log_tails(self, lines: int) -> str:
        """The last ``lines`` of every component's and engine's log: what a failed lab test shows of the
        cluster, since its work folder is gone by the time anyone reads the report."""
        out = []
        for log in sorted((self.workdir / "logs").rglob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.relative_to(self.workdir)}\n" + "\n".join(tail))
        return "\n".join(out)

    def dead(self) -> list[str]:
        return [f"{name} (exit {p.returncode})" for name, p in self.procs.items() if p.poll() is not None]

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Every node registered and seen by the router, then one request down each path, from the client
        host: the first P/D request pays the first pull's one-off costs, which no test should time."""
        deadline = time.monotonic() + timeout_s
        with self.lab.inside("client"), httpx.Client(timeout=5) as http:
            while True:
                if self.dead():
                    raise RuntimeError(f"lab cluster process died during start-up: {', '.join(self.dead())}")
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    if sum(http.get(f"{self.router_url}/health").json().get("nodes", {}).values()) >= len(NODES):
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"lab cluster not ready after {timeout_s:.0f} s")
                time.sleep(1.0)  # polling processes that have no readiness callback
            self.model = http.get(f"{self.router_url}/v1/models").json()["data"][0]["id"]
            for route in ("disaggregated", "colocated"):
                resp = http.post(
                    f"{self.router_url}/v1/chat/completions",
                    headers={"x-tandem-route": route},
                    json={"model": self.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                    timeout=START_TIMEOUT_S,
                )
                assert resp.status_code == 200, f"warm-up ({route}): {resp.status_code} {resp.text[:300]}"

    def stop(self) -> None:
        """Router first (no new work), then the nodes (they deregister and stop their engines), then the
        stores; the lab's ``down`` then kills whatever is left in its namespaces."""
        order = ["router", *NODES, "lake-writer", "postgres", "redis"]
        for name in order:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                # PostgreSQL's fast shutdown is SIGINT; everything else stops on SIGTERM.
                os.killpg(proc.pid, signal.SIGINT if name == "postgres" else signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        print(self.log_tails(15))
        if self._pg_dir is not None:
            shutil.rmtree(self._pg_dir, ignore_errors=True)


def node_id(host: str) -> str:
    return f"{host}-{NODE_PORT}"


def _netns_pids(namespace: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True).stdout
    return [int(p) for p in out.split()]


def _sum_metric(text: str, name: str) -> float:
    """Sum of a metric's samples over its labels (0 when the engine has not published it yet)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.contextmanager
def lab_cluster(workdir: Path, spec: LabSpec = SPEC, *, lake: bool = False):  # noqa: ANN201 - of LabCluster
    """The cluster up on a lab of ``spec`` (its hosts must include SPEC's), stopped and the lab removed after."""
    with Lab(spec) as lab:
        cluster = LabCluster(lab, workdir)
        try:
            cluster.start_store()
            if lake:
                cluster.start_lake_writer()
            cluster.start_nodes()
            cluster.start_router()
            cluster.wait_ready()
            yield cluster
        finally:
            cluster.stop()
