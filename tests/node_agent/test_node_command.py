"""The `vllm serve` command a node builds for each role."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from contracts.registry import Role
from kv_transfer import ConnectorKind
from node_agent.node import engine_command, engine_env
from node_agent.settings import NodeSettings
from tandem.cli import app


def _args(role: Role, **kw) -> list[str]:
    return engine_command(NodeSettings(role=role, port=9100, **kw), Path("/models/m"))


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_prefill_and_decode_get_the_tandem_connector_by_default_both_gets_none() -> None:
    for role in (Role.PREFILL, Role.DECODE):
        cfg = json.loads(_value(_args(role), "--kv-transfer-config"))
        assert cfg["kv_connector"] == "TandemConnector"
        assert cfg["kv_connector_module_path"] == "kv_connector.connector"
        assert cfg["kv_load_failure_policy"] == "recompute"
        extra = cfg["kv_connector_extra_config"]
        assert extra["port"] == 9103 and extra["host"] == "127.0.0.1" and extra["transport"] == "auto"
        nixl = json.loads(_value(_args(role, connector=ConnectorKind.NIXL), "--kv-transfer-config"))
        assert nixl["kv_connector"] == "NixlConnector" and nixl["kv_buffer_device"] == "cpu"
    assert "--kv-transfer-config" not in _args(Role.BOTH)
    assert "--kv-transfer-config" not in _args(Role.DECODE, connector=ConnectorKind.NONE)


def test_kv_events_prefix_caching_and_loopback_ports() -> None:
    cmd = _args(Role.DECODE)
    events = json.loads(_value(cmd, "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True
    # vLLM binds only wildcard/ipc publisher endpoints: loopback nodes publish on ipc.
    assert events["endpoint"].startswith("ipc://") and events["endpoint"].endswith("kv-events-9100.sock")
    assert events["replay_endpoint"] == "tcp://127.0.0.1:9102"
    assert "--enable-prefix-caching" in cmd and _value(cmd, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert "--enable-prompt-tokens-details" in cmd
    assert _value(cmd, "--tool-call-parser") == "pythonic" and "--enable-auto-tool-choice" in cmd
    assert _value(cmd, "--host") == "127.0.0.1" and _value(cmd, "--port") == "9100"


def test_a_node_on_a_real_interface_keeps_its_engines_events_on_the_host_behind_the_relay() -> None:
    s = NodeSettings(role=Role.DECODE, host="10.1.2.3", port=9100)
    assert s.kv_events_relayed
    assert s.kv_events_bind.startswith("ipc://") and s.kv_replay_bind.startswith("ipc://")
    assert s.kv_events_endpoint == "tcp://10.1.2.3:9101" and s.kv_replay_endpoint == "tcp://10.1.2.3:9102"
    assert s.relay_binds == ("tcp://10.1.2.3:9101", "tcp://10.1.2.3:9102")


def test_role_specific_token_budgets() -> None:
    assert _value(_args(Role.PREFILL, max_model_len=8192), "--max-num-batched-tokens") == "4096"
    assert _value(_args(Role.DECODE, max_model_len=4096), "--max-num-batched-tokens") == "2048"
    assert "--max-num-batched-tokens" not in _args(Role.BOTH)


def test_engine_env_pins_cores_and_separates_nixl_ports() -> None:
    env = engine_env(NodeSettings(role=Role.PREFILL, port=9100, cores="0", kv_cache_gib=2))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "9103"


@pytest.mark.parametrize("role", list(Role))
def test_every_engine_starts_with_the_hooks(role: Role) -> None:
    from kv_transfer import ENGINE_HOOKS

    env = engine_env(NodeSettings(role=role))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ENGINE_HOOKS)


def test_nixl_engines_start_with_the_hook_that_demotes_the_busy_progress_thread() -> None:
    env = engine_env(NodeSettings(role=Role.DECODE, connector=ConnectorKind.NIXL))
    assert env["TANDEM_NIXL_PROGRESS_THREAD"] == "idle"
    assert (
        engine_env(NodeSettings(role=Role.DECODE, connector=ConnectorKind.NIXL, nixl_progress_thread="normal"))[
            "TANDEM_NIXL_PROGRESS_THREAD"
        ]
        == "normal"
    )


def test_engine_spin_is_capped_on_cpu_builds_and_as_told(monkeypatch: pytest.MonkeyPatch) -> None:
    import node_agent.dtype

    monkeypatch.setenv("TANDEM_ENGINE_SPIN_MS", "7")  # an outer setting must not leak into the engine
    monkeypatch.setattr(node_agent.dtype, "is_cpu_build", lambda: True)
    assert engine_env(NodeSettings(role=Role.DECODE, cores="0-1"))["TANDEM_ENGINE_SPIN_MS"] == "1000"
    assert engine_env(NodeSettings(role=Role.DECODE, engine_spin_ms=2.5))["TANDEM_ENGINE_SPIN_MS"] == "2.5"
    monkeypatch.setattr(node_agent.dtype, "is_cpu_build", lambda: False)  # GPU build: vLLM's own spin
    assert "TANDEM_ENGINE_SPIN_MS" not in engine_env(NodeSettings(role=Role.DECODE))
    assert engine_env(NodeSettings(role=Role.DECODE, engine_spin_ms=0))["TANDEM_ENGINE_SPIN_MS"] == "0"


def test_a_cpu_engine_keeps_vllms_spin_with_the_wake_up_fixes_whatever_its_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A spinner yields to the worker at once, where a sleeper waits behind it for the scheduler
    (measured: 40 s against 55 s with spin 0 for two one-core nodes' sessions; one two-core engine, one
    stream: 24.5 ms per token against 123 ms). 0 only when told."""
    import node_agent.dtype

    monkeypatch.setattr(node_agent.dtype, "is_cpu_build", lambda: True)
    assert engine_env(NodeSettings(role=Role.BOTH, cores="1"))["TANDEM_ENGINE_SPIN_MS"] == "1000"
    assert engine_env(NodeSettings(role=Role.BOTH, cores="2,3"))["TANDEM_ENGINE_SPIN_MS"] == "1000"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert engine_env(NodeSettings(role=Role.BOTH))["TANDEM_ENGINE_SPIN_MS"] == "1000"
    assert engine_env(NodeSettings(role=Role.BOTH, engine_spin_ms=0))["TANDEM_ENGINE_SPIN_MS"] == "0"


@pytest.mark.parametrize(
    ("setting", "reader_spin_s", "writer_hwm", "recheck_ms"),
    [("", 1.0, 1, 5000), ("0", 0.0, 0, 100), ("2.5", 0.0025, 0, 100)],
)
def test_engine_hook_caps_the_step_queue_spin_in_a_real_interpreter(
    setting: str, reader_spin_s: float, writer_hwm: int, recheck_ms: int
) -> None:
    """vLLM's own SpinCondition, imported after start-up as vLLM imports it: its readers spin at most
    the setting (empty: vLLM's 1 s), writers never spin; with the setting, no notification is dropped
    (no high-water mark) and a sleeping reader looks again every 100 ms."""
    import subprocess
    import sys

    from kv_transfer import ENGINE_HOOKS

    code = (
        "import zmq, tempfile, os\n"
        "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
        "d = tempfile.mkdtemp()\n"
        "ctx = zmq.Context()\n"
        "reader = SpinCondition(True, ctx, f'ipc://{d}/r')\n"
        "writer = SpinCondition(False, ctx, f'ipc://{d}/w')\n"
        "import vllm.distributed.device_communicators.shm_broadcast as m\n"
        "hwm = writer.local_notify_socket.getsockopt(zmq.SNDHWM)\n"
        "print(reader.busy_loop_s, writer.busy_loop_s, hwm, m.SHM_READER_RECHECK_INTERVAL_MS)"
    )
    env = {**os.environ, "PYTHONPATH": str(ENGINE_HOOKS), "TANDEM_ENGINE_SPIN_MS": setting}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    reader, writer, hwm, recheck = map(float, out.stdout.split()[-4:])
    assert reader == pytest.approx(reader_spin_s)
    assert writer == 0
    assert (hwm, recheck) == (writer_hwm, recheck_ms)


def test_engine_hook_moves_nixl_threads_to_sched_idle_in_a_real_interpreter() -> None:
    import subprocess
    import sys

    from kv_transfer import ENGINE_HOOKS

    code = (
        "import os, nixl_cu12._api as a\n"
        "before = {int(t) for t in os.listdir('/proc/self/task')}\n"
        "agent = a.nixl_agent('t', a.nixl_agent_config(num_threads=2))\n"
        "new = {int(t) for t in os.listdir('/proc/self/task')} - before\n"
        "print(len(new), sorted({os.sched_getscheduler(t) for t in new}) == [os.SCHED_IDLE])"
    )
    out = (
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONPATH": str(ENGINE_HOOKS)},
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
        .split()
    )
    assert int(out[0]) >= 1 and out[1] == "True"


def test_parse_cores() -> None:
    from node_agent.node import parse_cores

    assert parse_cores("0") == {0}
    assert parse_cores("0-2") == {0, 1, 2}
    assert parse_cores("0,2-3") == {0, 2, 3}


def test_pin_process_tree_pins_children_threads() -> None:
    import subprocess
    import sys

    from node_agent.node import pin_process_tree

    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\ntime.sleep(30)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        import psutil

        from tests.support.helpers import wait_for

        assert wait_for(lambda: len(psutil.Process(parent.pid).children()) == 1, timeout_s=10)
        target = {sorted(os.sched_getaffinity(0))[-1]}
        assert pin_process_tree(parent.pid, target) >= 2
        child = psutil.Process(parent.pid).children()[0]
        assert os.sched_getaffinity(parent.pid) == target and os.sched_getaffinity(child.pid) == target
    finally:
        for p in psutil.Process(parent.pid).children():
            p.kill()
        parent.kill()
        parent.wait()


def test_pin_process_tree_keeps_threads_already_inside_the_node() -> None:
    """A thread vLLM bound to one core of the node (its OpenMP threads) is neither widened nor moved;
    one that may run outside the node's cores is narrowed to them."""
    import subprocess
    import sys

    import psutil

    from node_agent.node import pin_process_tree

    all_cores = os.sched_getaffinity(0)
    if len(all_cores) < 2:
        import pytest

        pytest.fail("this test needs a host with at least 2 cores")
    first, last = sorted(all_cores)[0], sorted(all_cores)[-1]
    bound = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    loose = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.sched_setaffinity(bound.pid, {first})
        node = {first}
        # both processes are "the engine": pin each tree with the node's core set
        assert pin_process_tree(bound.pid, node) == 0
        assert os.sched_getaffinity(bound.pid) == {first}
        assert pin_process_tree(loose.pid, node) >= 1
        assert os.sched_getaffinity(loose.pid) == {first}
        # a node with every core widens nothing that is bound to one of them
        assert pin_process_tree(bound.pid, all_cores) == 0
        assert os.sched_getaffinity(bound.pid) == {first}
        # a thread bound to a core outside the node is moved into it
        os.sched_setaffinity(loose.pid, {last})
        assert pin_process_tree(loose.pid, {first}) == 1
        assert os.sched_getaffinity(loose.pid) == {first}
        assert psutil.Process(bound.pid).is_running()
    finally:
        for p in (bound, loose):
            p.kill()
            p.wait()


def test_engine_traces_go_to_the_otlp_endpoint_over_http_only_when_one_is_set(monkeypatch) -> None:
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME", "TANDEM_NODE_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    off = NodeSettings(role=Role.PREFILL, port=9100, node_id="p0")
    assert "--otlp-traces-endpoint" not in engine_command(off, Path("/models/m"))
    env = engine_env(off)
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in env and "OTEL_SERVICE_NAME" not in env

    url = "http://10.0.0.9:4318/v1/traces"
    monkeypatch.setenv("TANDEM_NODE_OTLP_TRACES_ENDPOINT", url)
    on = NodeSettings(role=Role.PREFILL, port=9100, node_id="p0")
    assert _value(engine_command(on, Path("/models/m")), "--otlp-traces-endpoint") == url
    env = engine_env(on)
    # vLLM's exporter would speak gRPC without it (vllm/tracing/otel.py get_span_exporter)
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_SERVICE_NAME"] == "vllm-p0"
    # An operator's own protocol choice stands.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert engine_env(on)["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"


def test_a_host_tier_adds_its_connector_alone_or_after_the_pd_one() -> None:
    tier = "ipc:///tmp/t/tier.sock"
    both = json.loads(
        _value(_args(Role.BOTH, host_tier_endpoint=tier, host_tier_timeout_s=2.5), "--kv-transfer-config")
    )
    assert both["kv_connector"] == "HostTierConnector"
    assert both["kv_connector_extra_config"] == {"tier_endpoint": tier, "tier_timeout_s": 2.5}
    assert both["kv_load_failure_policy"] == "recompute"  # a block that fails its checksum is recomputed
    for role in (Role.PREFILL, Role.DECODE):
        multi = json.loads(_value(_args(role, host_tier_endpoint=tier), "--kv-transfer-config"))
        assert multi["kv_connector"] == "MultiConnector"
        names = [c["kv_connector"] for c in multi["kv_connector_extra_config"]["connectors"]]
        assert names == ["TandemConnector", "HostTierConnector"]  # a remote prefill stays with P/D
    none = json.loads(
        _value(_args(Role.DECODE, connector=ConnectorKind.NONE, host_tier_endpoint=tier), "--kv-transfer-config")
    )
    assert none["kv_connector"] == "HostTierConnector"


def test_the_registry_advertises_the_block_server_the_engine_binds() -> None:
    """What a router names in a layer-wise decode leg is what the engine's connector serves: the
    endpoints its own kv_transfer_params would carry, from the same extra config."""
    from kv_transfer.settings import ConnectorSettings, host_id
    from node_agent.node import block_server

    for role in (Role.PREFILL, Role.DECODE):
        settings = NodeSettings(role=role, port=9100)
        extra = json.loads(_value(_args(role), "--kv-transfer-config"))["kv_connector_extra_config"]
        endpoints, host = block_server(settings)
        assert endpoints == ConnectorSettings.model_validate(extra).endpoints
        assert endpoints["tcp"] == "tcp://127.0.0.1:9103" and host == host_id()
    assert block_server(NodeSettings(role=Role.BOTH, port=9100)) == ({}, "")
    assert block_server(NodeSettings(role=Role.PREFILL, port=9100, connector=ConnectorKind.NIXL)) == ({}, "")


def test_a_registry_ttl_shorter_than_a_heartbeat_round_is_refused_in_one_line() -> None:
    """The TTL must outlast heartbeat_s plus both probe timeouts, or one slow probe of a live engine drops
    the node from routing; `tandem node` says so without a traceback (exit 2, as for a bad flag)."""
    with pytest.raises(ValidationError, match="must exceed heartbeat_s"):
        NodeSettings(role=Role.BOTH, heartbeat_s=2.0, health_timeout_s=5.0, registry_ttl_s=6.0)
    assert NodeSettings(role=Role.BOTH).registry_ttl_s > 2.0 + 2 * 5.0  # the defaults hold
    result = CliRunner().invoke(app, ["node", "--role", "both"], env={"TANDEM_NODE_REGISTRY_TTL_S": "3"})
    assert result.exit_code == 2, result.output
    assert "registry_ttl_s (3 s) must exceed" in result.output
