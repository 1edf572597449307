"""Two regions of a Tandem cluster in one lab (``infra.lab``), what the region failover test runs on.

    region a (10.<net>.0.0/24)                      region b (10.<net>.1.0/24)
    router-a  .0.10  tandem router, region a        router-b  .1.10  tandem router, region b
    node-a    .0.11  tandem node --role both        node-b    .1.11  tandem node --role both
    store-a   .0.12  Redis a, PostgreSQL primary    store-b   .1.12  Redis b, PostgreSQL streaming replica
    client    .0.13  the test's client (no process)

Each region has its own router, node and Redis (node registry, keys, rate limits, the region's session
cache): a router sees only its region's node. The persistent store is one PostgreSQL database with two
real servers: the primary in region a, and in region b a hot standby made by ``pg_basebackup -R`` that
streams the primary's WAL asynchronously (replication user ``replicator``).

Both routers get one multi-host URL with ``target_session_attrs=read-write``, their own region's server
first (``region_dsn``): a connection goes to the first server that takes writes. While the primary lives
that is region a's server for both routers (region b's router reads and writes across the inter-region
link: one writable store, so there is no conflict to resolve); once region a is lost and an operator
promotes the standby (``promote``: ``pg_ctl promote``), router-b's next connection lands on its own
server, now writable. Sessions cross regions as ``router.sessions`` describes: every turn is in the store
(and so, after the replication lag, in region b's replica); a region's cache gets a session's turns when
it is that region's home or already holds the session, and otherwise refills from the store on its
first read.

Losing region a (``lose_region_a``) is what a power cut looks like from region b: the hosts of region a
are cut off their bridge first, so no FIN or RST escapes them, then every process in them is killed.
The client host stays up on region a's bridge, joined to region b by the inter-region link, like a
user whose provider still reaches the surviving region.

Redis and PostgreSQL demand the cluster's store password (``tests.lab.cluster`` explains why the lab
runs its own servers rather than the machine's). Every process holds the one cluster secret; each host
has its own ``TMPDIR``. ``LabCluster`` gives the process handling (spawn, logs, stop).
"""

from __future__ import annotations

import asyncio
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
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx

from infra.lab import Lab, LabSpec
from tests.lab.cluster import PG_BIN, PG_PORT, REDIS_PORT, START_TIMEOUT_S, LabCluster

SPEC = LabSpec(
    "rgn",
    {"router-a": 0, "node-a": 0, "store-a": 0, "client": 0, "router-b": 1, "node-b": 1, "store-b": 1},
    net=234,
)
REGIONS = ("a", "b")
CORES = {"a": "0", "b": "1"}
"""One engine per region, each on its own core of a 2-core host."""
NODE_PORT = 8100
ROUTER_PORT = 8000
FAILOVER_S = 2.0
"""The routers' ``TANDEM_DATABASE_CONNECT_TIMEOUT_S``."""
AS_POSTGRES = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]


def _netns_pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10)
    return [int(pid) for pid in done.stdout.split()]


@dataclass
class RegionsCluster(LabCluster):
    replication_password: str = field(default_factory=lambda: secrets.token_hex(16))
    _pg_root: Path | None = None

    # -- addresses ------------------------------------------------------------------------------------
    def region_redis_url(self, region: str) -> str:
        return f"redis://:{self.store_password}@{self.lab.address(f'store-{region}')}:{REDIS_PORT}/0"

    def server_url(self, region: str) -> str:
        """One PostgreSQL server's URL (the operator's view; the routers get ``region_dsn``)."""
        return f"postgresql://postgres:{self.store_password}@{self.lab.address(f'store-{region}')}:{PG_PORT}/postgres"

    def region_dsn(self, region: str) -> str:
        """What ``region``'s router is given: both servers, its own first, the writable one taken."""
        order = sorted(REGIONS, key=lambda r: r != region)
        hosts = ",".join(f"{self.lab.address(f'store-{r}')}:{PG_PORT}" for r in order)
        return f"postgresql://postgres:{self.store_password}@{hosts}/postgres?target_session_attrs=read-write"

    def region_router_url(self, region: str) -> str:
        return f"http://{self.lab.address(f'router-{region}')}:{ROUTER_PORT}"

    # -- processes ------------------------------------------------------------------------------------
    def _region_env(self, host: str, region: str) -> dict[str, str]:
        """``LabCluster._env`` with the region's own Redis (that one names the single store host)."""
        tmp = self.workdir / "hosts" / host
        tmp.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        return {
            **env,
            "TMPDIR": str(tmp),
            "TANDEM_CLUSTER_SECRET": self.secret,
            "TANDEM_REDIS_URL": self.region_redis_url(region),
            "PYTHONUNBUFFERED": "1",
        }

    def _pg_home(self, region: str) -> Path:
        assert self._pg_root is not None
        return self._pg_root / region

    def _start_pg(self, region: str, data: Path) -> None:
        address = self.lab.address(f"store-{region}")
        self._spawn(
            f"postgres-{region}",
            f"store-{region}",
            [*AS_POSTGRES, str(PG_BIN / "postgres"), "-D", str(data), "-p", str(PG_PORT)]
            + ["-c", f"listen_addresses={address}", "-c", f"unix_socket_directories={self._pg_home(region)}"]
            + ["-c", "fsync=off", "-c", "max_connections=50", "-c", "wal_receiver_status_interval=1"],
        )
        ready = [str(PG_BIN / "pg_isready"), "-q", "-h", address, "-p", str(PG_PORT)]
        deadline = time.monotonic() + 60
        while self.lab.run(f"store-{region}", ready, timeout=10).returncode != 0:
            if self.dead() or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL {region} did not start: {', '.join(self.dead()) or 'timeout'}")
            time.sleep(0.2)  # polling a server that has no readiness callback

    def _as_postgres(self, host: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        done = subprocess.run(
            self.lab.command(host, [*AS_POSTGRES, *argv]), capture_output=True, text=True, timeout=120, env=env
        )
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} in {host} failed: {done.stderr.strip() or done.stdout.strip()}")

    def start_stores(self) -> None:
        """Redis in each region; the PostgreSQL primary in a, then its standby in b, streaming."""
        for region in REGIONS:
            address = self.lab.address(f"store-{region}")
            self._spawn(
                f"redis-{region}",
                f"store-{region}",
                ["redis-server", "--bind", address, "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no"]
                + ["--requirepass", self.store_password],
            )
        # PostgreSQL will not run as root: its folders belong to the postgres user, outside pytest's
        # root-only temporary tree.
        self._pg_root = Path(tempfile.mkdtemp(prefix="tandem-lab-rgn-"))
        for region in REGIONS:
            self._pg_home(region).mkdir()
            shutil.chown(self._pg_home(region), "postgres", "postgres")
        shutil.chown(self._pg_root, "postgres", "postgres")
        password = self._pg_root / "pw"
        password.write_text(self.store_password + "\n")
        shutil.chown(password, "postgres", "postgres")
        primary = self._pg_home("a") / "data"
        self._as_postgres(
            "store-a",
            [str(PG_BIN / "initdb"), "-D", str(primary), "-U", "postgres", f"--pwfile={password}"]
            + ["--auth-host=scram-sha-256", "--auth-local=peer", "--no-sync"],
        )
        with open(primary / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all 10.{self.lab.spec.net}.0.0/16 scram-sha-256\n")
            hba.write(f"host replication replicator {self.lab.subnet(1)} scram-sha-256\n")
        self._start_pg("a", primary)
        create = f"CREATE ROLE replicator WITH REPLICATION LOGIN PASSWORD '{self.replication_password}'"
        self._as_postgres("store-a", [str(PG_BIN / "psql"), "-h", str(self._pg_home("a")), "-c", create])
        standby = self._pg_home("b") / "data"
        self._as_postgres(
            "store-b",
            [str(PG_BIN / "pg_basebackup"), "-h", self.lab.address("store-a"), "-p", str(PG_PORT)]
            + ["-U", "replicator", "-D", str(standby), "-R", "-X", "stream", "--checkpoint=fast", "--no-sync"],
            env={**os.environ, "PGPASSWORD": self.replication_password},
        )
        self._start_pg("b", standby)

    def start_nodes(self) -> None:
        for region in REGIONS:
            host = f"node-{region}"
            argv = [sys.executable, "-m", "tandem", "node", "--role", "both", "--port", str(NODE_PORT)]
            argv += ["--node-id", f"{host}-{NODE_PORT}", "--dtype", "float32"]
            argv += ["--cores", CORES[region], "--log-dir", str(self.workdir / "logs" / host)]
            env = {**self._region_env(host, region), "TANDEM_NODE_HOST": self.lab.address(host)}
            self._spawn(host, host, argv, env)

    def start_routers(self) -> None:
        """One router after the other: two routers creating the tables of a fresh PostgreSQL at once
        race (``CREATE TABLE IF NOT EXISTS`` is not safe against a concurrent one: the loser fails on
        a unique index of the catalogue and the router exits)."""
        caches = json.dumps({r: self.region_redis_url(r) for r in REGIONS})
        for region in REGIONS:
            host = f"router-{region}"
            argv = [sys.executable, "-m", "tandem", "router", "--host", self.lab.address(host)]
            argv += ["--port", str(ROUTER_PORT)]
            env = {
                **self._region_env(host, region),
                "TANDEM_DATABASE_URL": self.region_dsn(region),
                "TANDEM_REGION": region,
                "TANDEM_REGION_CACHE_URLS": caches,
                # How long a statement may sit unacknowledged on a connection to a lost server before
                # the router connects elsewhere (``router.sessions.sql``): the lab's links answer in
                # well under a millisecond.
                "TANDEM_DATABASE_CONNECT_TIMEOUT_S": str(FAILOVER_S),
                "TANDEM_ROUTER_TELEMETRY_JOURNAL_DIR": str(self.workdir / f"journal-{region}"),
            }
            self._spawn(host, host, argv, env)
            self._wait_router(region)

    def _wait_router(self, region: str, timeout_s: float = 120.0) -> None:
        """The router answers HTTP (``/health`` says 503 while it sees no node: enough for the store)."""
        deadline = time.monotonic() + timeout_s
        with self.lab.inside("client"), httpx.Client(timeout=2) as http:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    http.get(f"{self.region_router_url(region)}/health")
                    return
                if self.dead() or time.monotonic() > deadline:
                    raise RuntimeError(f"router {region} did not start: {', '.join(self.dead()) or 'timeout'}")
                time.sleep(0.2)  # polling a process that has no readiness callback

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Each router sees its region's node, then one warm-up request per region from the client host
        (the first request of an engine pays one-off costs no test should time)."""
        deadline = time.monotonic() + timeout_s
        with self.lab.inside("client"), httpx.Client(timeout=5) as http:
            for region in REGIONS:
                url = self.region_router_url(region)
                while True:
                    if self.dead():
                        raise RuntimeError(f"lab process died during start-up: {', '.join(self.dead())}")
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        if sum(http.get(f"{url}/health").json().get("nodes", {}).values()) >= 1:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"region {region} not ready after {timeout_s:.0f} s")
                    time.sleep(1.0)  # polling processes that have no readiness callback
                self.model = http.get(f"{url}/v1/models").json()["data"][0]["id"]
                resp = http.post(
                    f"{url}/v1/chat/completions",
                    json={"model": self.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                    timeout=START_TIMEOUT_S,
                )
                assert resp.status_code == 200, f"warm-up ({region}): {resp.status_code} {resp.text[:300]}"

    # -- the operator's actions -----------------------------------------------------------------------
    def lose_region_a(self) -> None:
        """Region a's hosts cut off first (nothing they send escapes: a power cut, not a shutdown), then
        every process of region a killed at once."""
        hosts = [h for h, region in self.lab.spec.hosts.items() if region == 0 and h != "client"]
        for host in hosts:
            self.lab.cut(host)
        for host in hosts:  # every process in them, as ``ip netns pids`` lists it (PostgreSQL's backends too)
            for pid in _netns_pids(self.lab.hosts[host].namespace):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for name, proc in self.procs.items():
            if name.endswith("-a"):
                proc.wait(30)

    def promote(self) -> None:
        """What an operator does once region a is lost: region b's standby becomes the primary."""
        data = self._pg_home("b") / "data"
        self._as_postgres("store-b", [str(PG_BIN / "pg_ctl"), "promote", "-w", "-D", str(data)])

    # -- looking at the stores (as the operator, from the client host) ---------------------------------
    def query(self, region: str, sql: str, *args: object) -> list[asyncpg.Record]:
        async def run() -> list[asyncpg.Record]:
            conn = await asyncpg.connect(self.server_url(region), timeout=5)
            try:
                return await conn.fetch(sql, *args)
            finally:
                await conn.close()

        with self.lab.inside("client"):
            return asyncio.run(run())

    def stop(self) -> None:
        """Routers, nodes, then stores, of the regions not lost (the lab's ``down`` kills whatever is left),
        then ``LabCluster.stop``, which finds nothing of its own to stop and prints each log's tail."""
        for name in [f"{kind}-{r}" for kind in ("router", "node", "postgres", "redis") for r in REGIONS]:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            # PostgreSQL's fast shutdown is SIGINT; everything else stops on SIGTERM.
            first = signal.SIGINT if name.startswith("postgres") else signal.SIGTERM
            for sig, wait_s in ((first, 60.0), (signal.SIGKILL, None)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(wait_s)
                    break
        super().stop()
        if self._pg_root is not None:
            shutil.rmtree(self._pg_root, ignore_errors=True)


@contextlib.contextmanager
def regions_cluster(workdir: Path, *, engines: bool = True) -> Iterator[RegionsCluster]:
    """The two regions, started; ``engines=False``: the stores only (for checks of the store's own failover)."""
    with Lab(SPEC) as lab:
        cluster = RegionsCluster(lab, workdir)
        try:
            cluster.start_stores()
            if engines:
                cluster.start_nodes()
                cluster.start_routers()
                cluster.wait_ready()
            yield cluster
        finally:
            cluster.stop()
