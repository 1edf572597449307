"""`tandem up` keeps the cluster up and takes it all down with it (issue 12), on real processes: the real
launcher, node agent, router and lake writer, with the node's engine replaced by a STAND-IN engine
process (``TANDEM_NODE_ENGINE_COMMAND``, tests/support/fake_engine.py) so no vLLM engine is needed.
The same with vLLM engines: tests/e2e/test_supervision.py. Redis DB 12."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from contracts.registry import NODES_SET, NodeInfo, node_key
from infra.launcher import launcher_key
from tests.node_agent.test_supervisor import free_port_block
from tests.support.helpers import alive_pids, wait_for

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/12"
PY = sys.executable


@dataclass
class Up:
    proc: subprocess.Popen[str]
    router_port: int
    node_port: int
    lines: queue.Queue[str]
    seen: list[str] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    """Every process of the cluster ever seen (descendants of `tandem up`)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def node_id(self) -> str:
        return f"both-0-{self.node_port}"

    def wait_line(self, prefix: str, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no line starting {prefix!r} in {timeout_s} s:\n{''.join(self.seen[-30:])}"
                ) from None
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def descendants(self) -> list[psutil.Process]:
        procs = psutil.Process(self.proc.pid).children(recursive=True)
        self.pids.update(p.pid for p in procs)
        return procs

    def child(self, needle: str) -> psutil.Process:
        """The child whose command line holds ``needle``; of several (router replicas), the first started."""
        matches = [p for p in self.descendants() if needle in " ".join(p.cmdline())]
        assert matches, f"no child {needle!r}"
        return min(matches, key=lambda p: (p.create_time(), p.pid))

    def epoch(self) -> int:
        raw = redis.Redis.from_url(REDIS_URL).get(node_key(self.node_id))
        if raw is None:
            return 0
        import msgspec

        return msgspec.msgpack.decode(raw, type=NodeInfo).epoch

    def alive(self) -> list[int]:
        out = []
        for pid in self.pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.NoSuchProcess:
                pass
        return out


@contextlib.contextmanager
def run_up(cwd: Path, *args: str) -> Iterator[Up]:
    """``tandem up --colocated`` in ``cwd`` (with ``args``), its engine a stand-in; killed afterwards."""
    redis.Redis.from_url(REDIS_URL).flushdb()
    router_port, node_port = free_port_block(), free_port_block()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
        "TANDEM_NODE_ENGINE_COMMAND": json.dumps([PY, "-m", "tests.support.fake_engine", "--port", "{port}"]),
        "TANDEM_NODE_HEARTBEAT_S": "0.2",
        "TANDEM_NODE_RESTART_BACKOFF_S": "0.1",
    }
    env.pop("TANDEM_LAKE_DIR", None)
    command = [PY, "-m", "tandem", "up", "--colocated", "--port", str(router_port)]
    command += ["--node-base-port", str(node_port), "--redis-url", REDIS_URL, *args]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env, cwd=cwd
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in iter(proc.stdout.readline, "")], daemon=True).start()
    u = Up(proc, router_port, node_port, lines)
    try:
        try:
            u.wait_line("READY ", 120)
        except AssertionError as exc:
            workdir = Path(args[args.index("--workdir") + 1]) if "--workdir" in args else cwd / ".tandem"
            logs = sorted((workdir / "logs").glob("*.log"))
            tails = [f"--- {p.name}:\n{p.read_text(errors='replace')[-3000:]}" for p in logs]
            raise AssertionError("\n".join([str(exc), *tails])) from None
        u.descendants()
        yield u
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)  # the children's parent-death signal takes the rest down
        proc.wait()
        for pid in u.alive():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    with run_up(ROOT, "--workdir", str(tmp_path)) as u:
        yield u


def test_after_tandem_up_lake_commands_with_no_flags_see_its_requests(tmp_path: Path) -> None:
    """The README's path: `tandem up` (default workdir), some requests, then `tandem lake query` and
    `tandem lake report` with no flags, from the same directory."""
    with run_up(tmp_path) as u:
        for i in range(3):
            body = {"model": "fake", "messages": [{"role": "user", "content": f"lake {i}"}], "max_tokens": 4}
            assert httpx.post(f"{u.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
        env = {k: v for k, v in os.environ.items() if k != "TANDEM_LAKE_DIR"} | {"PYTHONPATH": str(ROOT)}

        def lake(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [PY, "-m", "tandem", "lake", *args], cwd=tmp_path, env=env, capture_output=True, text=True
            )

        def counted() -> bool:
            # 3 requests and the launcher's own warm-up request
            out = lake("query", "SELECT 'rows=' || count(*) AS n FROM requests WHERE status = 'ok'")
            return out.returncode == 0 and "rows=4" in out.stdout

        assert wait_for(counted, timeout_s=60), lake("query", "SELECT count(*) AS n FROM requests").stderr
        report = lake("report", "--out", str(tmp_path / "report"))
        assert report.returncode == 0 and "report on 4 requests" in report.stderr, report.stderr
    # And pointed at no lake, it says so and fails.
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    out = subprocess.run(
        [PY, "-m", "tandem", "lake", "query", "SELECT 1"], cwd=empty, env=env, capture_output=True, text=True
    )
    assert out.returncode != 0 and "no lake" in out.stderr


def test_dead_children_are_restarted_and_shown_and_sigterm_stops_everything(up: Up) -> None:
    router = up.child("tandem router")
    assert httpx.get(f"{up.url}/health").status_code == 200

    up.child("telemetry consume").kill()
    up.wait_line("RESTARTED lake-writer")
    assert httpx.get(f"{up.url}/health").status_code == 200  # one dead child stops nothing else

    epoch = up.epoch()
    up.child("tests.support.fake_engine").kill()  # the node agent restarts its engine, not the launcher
    assert wait_for(lambda: up.epoch() > epoch, timeout_s=30), "the node did not come back with a new epoch"

    router.kill()
    up.wait_line("RESTARTED router")
    assert wait_for(lambda: _health(up.url) == 200, timeout_s=60), "the restarted router never served"

    epoch = up.epoch()
    up.child(f"--node-id {up.node_id}").kill()  # the agent itself: the launcher restarts it
    up.wait_line(f"RESTARTED {up.node_id}")
    assert wait_for(lambda: up.epoch() > epoch, timeout_s=30), "the restarted agent did not register anew"
    assert len([p for p in up.descendants() if "tests.support.fake_engine" in " ".join(p.cmdline())]) == 1

    children = {
        k.decode(): json.loads(v)
        for k, v in redis.Redis.from_url(REDIS_URL).hgetall(launcher_key(up.router_port)).items()
    }
    assert children["lake-writer"]["restarts"] == 1 and children["router"]["restarts"] == 1
    assert children["lake-writer"]["last_exit"] == "killed by SIGKILL"
    assert children[up.node_id]["restarts"] == 1 and children[up.node_id]["state"] == "running"
    status = subprocess.run(
        [PY, "-m", "tandem", "cluster", "status", "--url", up.url, "--redis-url", REDIS_URL],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert status.returncode == 0, status.stderr
    assert "Processes of tandem up" in status.stdout and "Node agents" in status.stdout

    up.descendants()
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=60) == 0
    assert up.alive() == [], "processes of the cluster outlived a SIGTERM to tandem up"
    r = redis.Redis.from_url(REDIS_URL)
    assert not any(r.exists(node_key(n.decode())) for n in r.smembers(NODES_SET)), "node still registered"


def test_sigkill_of_tandem_up_takes_every_child_down(up: Up) -> None:
    up.descendants()
    assert len(up.pids) >= 4  # node agent, its engine, router, lake writer
    up.proc.send_signal(signal.SIGKILL)
    up.proc.wait()
    assert wait_for(lambda: up.alive() == [], timeout_s=60), f"left alive: {up.alive()}"


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def test_sigterm_to_a_running_bench_stops_every_process_it_started(tmp_path: Path) -> None:
    """`tandem bench admission` (the one benchmark without engines) starts a router and a stand-in
    engine; a SIGTERM mid-run unwinds it like Ctrl-C, and nothing it started survives."""
    bench = subprocess.Popen(
        [
            PY,
            "-m",
            "tandem",
            "bench",
            "admission",
            "--out",
            str(tmp_path / "b.json"),
            "-n",
            "300",
            "--requests",
            "100000",
            "--concurrency",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        cwd=ROOT,
    )
    seen: set[int] = set()

    def running_part_two() -> bool:
        kids = psutil.Process(bench.pid).children(recursive=True)
        seen.update(p.pid for p in kids)
        return len(kids) >= 2 and _health_any(kids)

    try:
        assert wait_for(running_part_two, timeout_s=120), "the bench never started its router and stand-in"
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=60)
        assert wait_for(lambda: not alive_pids(seen), timeout_s=30), f"left alive: {alive_pids(seen)}"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in alive_pids(seen):
            os.kill(pid, signal.SIGKILL)


def _health_any(procs: list[psutil.Process]) -> bool:
    """True once one of the bench's processes listens (the router is serving)."""
    for p in procs:
        try:
            if any(c.status == psutil.CONN_LISTEN for c in p.net_connections(kind="tcp")):
                return True
        except psutil.Error:
            pass
    return False


def test_a_named_cluster_keeps_its_state_under_its_name_and_leaves_the_status_when_stopped(tmp_path: Path) -> None:
    """``tandem up --cluster NAME``: the launcher's record of its processes and the node agent's status are
    under the cluster's prefix (``tandem cluster status`` finds them there, by the name the router gives);
    a clean stop deletes the launcher's record and leaves the node's status to lapse within a minute."""
    from contracts.cluster import key
    from contracts.registry import STOPPED_TTL_S, status_key

    with run_up(ROOT, "--cluster", "sup-a", "--workdir", str(tmp_path)) as u:
        r = redis.Redis.from_url(REDIS_URL)
        # the launcher writes its record once it supervises, just after READY
        assert wait_for(lambda: r.exists(launcher_key(u.router_port, "sup-a")), timeout_s=30)
        assert not r.exists(launcher_key(u.router_port))
        status = subprocess.run(
            [PY, "-m", "tandem", "cluster", "status", "--url", u.url, "--redis-url", REDIS_URL],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={k: v for k, v in {**os.environ, "COLUMNS": "200"}.items() if k != "TANDEM_CLUSTER"},
        )
        assert status.returncode == 0, status.stderr
        assert "Tandem cluster sup-a" in status.stdout and "Processes of tandem up" in status.stdout
        assert u.node_id in status.stdout
        u.proc.send_signal(signal.SIGTERM)
        assert u.proc.wait(timeout=60) == 0
    assert not r.exists(launcher_key(u.router_port, "sup-a"))
    ttl_ms = r.pttl(status_key(u.node_id, "sup-a"))
    assert 0 < ttl_ms <= STOPPED_TTL_S * 1000, f"the stopped node's status stays {ttl_ms} ms"
    assert not list(r.scan_iter(match=key("sup-a", "node", "*")))  # deregistered
