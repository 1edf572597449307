"""A node binds one address and registers another (issue 13): ``TANDEM_NODE_HOST`` is what the engine
and the KV sockets bind, ``TANDEM_NODE_ADVERTISE_HOST`` what routers and decode nodes are told. A
wildcard bind is never registered, and the agent reaches its own engine on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from contracts.registry import Role
from node_agent.node import describe, engine_command, engine_env
from node_agent.settings import NodeSettings

PORT = 18100


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def _engine(request: httpx.Request) -> httpx.Response:
    assert request.url.host == "127.0.0.1", "the agent must reach its engine locally"
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
    return httpx.Response(200, text="")


@pytest.mark.parametrize("role", [Role.PREFILL, Role.BOTH])
async def test_bind_everywhere_advertise_one_address(role: Role, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_NODE_HOST", "0.0.0.0")
    monkeypatch.setenv("TANDEM_NODE_ADVERTISE_HOST", "10.1.2.3")
    s = NodeSettings(role=role, port=PORT, block_size=16)
    cmd = engine_command(s, Path("/models/m"))
    assert _arg(cmd, "--host") == "0.0.0.0"
    events = json.loads(_arg(cmd, "--kv-events-config"))
    # The engine's events and replay stay on ipc sockets; the agent's CURVE relay binds every interface.
    assert events["endpoint"].startswith("ipc://") and events["replay_endpoint"].startswith("ipc://")
    assert s.relay_binds == (f"tcp://*:{PORT + 1}", f"tcp://*:{PORT + 2}")
    if role is Role.PREFILL:
        extra = json.loads(_arg(cmd, "--kv-transfer-config"))["kv_connector_extra_config"]
        assert extra["host"] == "10.1.2.3" and "bind_host" not in extra  # binds every interface
    assert engine_env(s)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.2.3"
    assert s.url == f"http://127.0.0.1:{PORT}"
    async with httpx.AsyncClient(transport=httpx.MockTransport(_engine)) as client:
        info = await describe(s, client, Path("/models/m"))
    assert info.url == f"http://10.1.2.3:{PORT}"
    assert info.kv_events_endpoint == f"tcp://10.1.2.3:{PORT + 1}"
    assert info.kv_replay_endpoint == f"tcp://10.1.2.3:{PORT + 2}"


def test_a_specific_bind_address_stays_the_bind_address() -> None:
    s = NodeSettings(role=Role.DECODE, host="192.168.0.7", advertise_host="node7.example", port=PORT)
    cmd = engine_command(s, Path("/models/m"))
    assert _arg(cmd, "--host") == "192.168.0.7"
    assert s.relay_binds[1] == f"tcp://192.168.0.7:{PORT + 2}"
    extra = json.loads(_arg(cmd, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["host"] == "node7.example" and extra["bind_host"] == "192.168.0.7"
    assert s.advertised_url == f"http://node7.example:{PORT}" and s.url == f"http://192.168.0.7:{PORT}"


def test_without_an_advertised_address_nothing_changes() -> None:
    s = NodeSettings(role=Role.PREFILL, host="10.0.0.5", port=PORT)
    assert s.advertised_url == s.url == f"http://10.0.0.5:{PORT}"
    assert s.kv_replay_endpoint == s.relay_binds[1] == f"tcp://10.0.0.5:{PORT + 2}"
    assert s.kv_connector_extra["host"] == "10.0.0.5" and "bind_host" not in s.kv_connector_extra
