"""A node never mistakes another process's engine for its own: a taken port fails it at once, with a
message naming the port and the process holding it (issue 12)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from contracts.errors import PortInUse
from contracts.registry import Role
from kv_transfer import ConnectorKind
from node_agent.ports import check_ports_free, port_free
from node_agent.settings import NodeSettings
from tests.node_agent.test_supervisor import free_port_block

ROOT = Path(__file__).resolve().parents[2]


def test_engine_ports_per_role() -> None:
    assert set(NodeSettings(role=Role.BOTH, port=9100).engine_ports) == {9100, 9102}
    assert NodeSettings(role=Role.DECODE, port=9100).engine_ports[9103] == "KV block server"
    assert NodeSettings(role=Role.PREFILL, port=9100, connector=ConnectorKind.NIXL).engine_ports[9103] == (
        "NIXL side channel"
    )
    # On a real interface the engine's KV events and replay are ipc sockets; the agent's relay binds
    # 9101 and 9102 (checked when the agent starts it).
    assert set(NodeSettings(role=Role.DECODE, host="10.0.0.1", port=9100).engine_ports) == {9100, 9103}


def test_a_taken_side_port_is_named_with_its_holder() -> None:
    port = free_port_block()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, time\n"
            f"s = socket.socket(); s.bind(('127.0.0.1', {port + 3})); s.listen()\n"
            "print('ok', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        with pytest.raises(PortInUse) as err:
            check_ports_free("127.0.0.1", NodeSettings(role=Role.DECODE, port=port).engine_ports)
        assert err.value.port == port + 3 and err.value.holder_pid == holder.pid
        assert f"port {port + 3} (KV block server)" in err.value.message
        assert f"pid {holder.pid} (python" in err.value.message
    finally:
        holder.kill()
        holder.wait()
    assert port_free("127.0.0.1", port + 3)


def test_tandem_node_with_its_port_taken_exits_at_once_naming_port_and_holder(redis_unit_url: str) -> None:
    port = free_port_block()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        t0 = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "tandem",
                "node",
                "--role",
                "decode",
                "--port",
                str(port),
                "--node-id",
                f"port-test-{port}",
                "--redis-url",
                redis_unit_url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, "COLUMNS": "300"},
        )
        took = time.monotonic() - t0
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, out
    assert f"port {port} (engine HTTP)" in out and f"pid {os.getpid()}" in out, out
    assert took < 20, f"took {took:.1f} s: the node must fail before starting any engine"
