"""A node agent whose Redis goes silent (accepts, never answers: issue 35) keeps looking after its engine:
every registry call is bounded by ``TANDEM_NODE_REDIS_TIMEOUT_S``, so a heartbeat that cannot be written
costs that long and no more. Real processes: ``tandem node`` with a STAND-IN engine
(tests/support/fake_engine.py), its Redis reached through a relay the test black-holes, then the engine
killed: the agent notices and starts a new one. Without the timeout it waits on the first silent reply
forever and never probes again."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from tests.node_agent.test_supervisor import ROOT, free_port_block
from tests.security.test_redis_blackhole import Relay

FAKE = "tests.support.fake_engine"


def _engines(agent: psutil.Process) -> set[int]:
    """The live stand-in engines under the agent (a killed one is a zombie until reaped)."""
    out = set()
    for p in agent.children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and FAKE in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


def test_a_silent_redis_does_not_stop_the_agent_restarting_its_engine(tmp_path: Path) -> None:
    relay = Relay()
    port = free_port_block()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "TANDEM_NODE_ENGINE_COMMAND": json.dumps(
            [sys.executable, "-m", "tests.support.fake_engine", "--port", "{port}"]
        ),
        "TANDEM_NODE_HEARTBEAT_S": "0.2",
        "TANDEM_NODE_REDIS_TIMEOUT_S": "0.5",
        "TANDEM_NODE_RESTART_BACKOFF_S": "0.1",
    }
    cmd = [sys.executable, "-m", "tandem", "node", "--role", "both", "--port", str(port)]
    cmd += ["--node-id", f"silent-{port}", "--redis-url", f"redis://127.0.0.1:{relay.port}/12"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in iter(proc.stdout.readline, "")], daemon=True).start()

    def wait_line(prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no line starting {prefix!r} within {timeout_s} s")

    try:
        wait_line("READY node", 60)
        agent = psutil.Process(proc.pid)
        [first] = _engines(agent)
        relay.blackhole.set()  # from now on every Redis call of the agent meets silence
        time.sleep(1.0)  # a few heartbeats into the silence: the agent is inside a registry call now
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (_engines(agent) - {first}):
            time.sleep(0.1)  # polling: a process of another tree has no event to wait on
        assert _engines(agent) - {first}, "the agent never started a new engine while Redis was silent"
        assert proc.poll() is None
    finally:
        relay.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
