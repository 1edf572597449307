"""One source for each setting: ``TANDEM_REDIS_URL`` is every process's Redis, and a CLI option left out
leaves the process's own setting (``TANDEM_NODE_*``, ``TANDEM_ROUTER_*``) in force instead of overriding
it with a default of its own."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from contracts.config import DEFAULT_REDIS_URL, redis_url
from node_agent.settings import NodeSettings
from router.policies import PolicyName
from router.settings import RouterSettings
from tandem.cli import app


def test_one_redis_setting_for_every_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    assert redis_url() == DEFAULT_REDIS_URL and redis_url(db=9) == "redis://127.0.0.1:6379/9"
    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://redis.example:6380/4")
    monkeypatch.setenv("TANDEM_NODE_REDIS_URL", "redis://not-this:1/0")  # no longer a setting
    monkeypatch.setenv("TANDEM_ROUTER_REDIS_URL", "redis://not-this:1/0")
    assert redis_url(db=9) == "redis://redis.example:6380/9"
    assert NodeSettings().redis_url == RouterSettings().redis_url == "redis://redis.example:6380/4"
    assert NodeSettings(redis_url="redis://given:1/2").redis_url == "redis://given:1/2"


def _node_settings(monkeypatch: pytest.MonkeyPatch, *args: str) -> NodeSettings:
    """The settings ``tandem node ARGS`` would run its node with (the node itself is not started)."""
    seen: list[NodeSettings] = []

    async def run_node(settings: NodeSettings) -> int:
        seen.append(settings)
        return 0

    monkeypatch.setattr("node_agent.node.run_node", run_node)
    result = CliRunner().invoke(app, ["node", *args])
    assert result.exit_code == 0, result.output
    return seen[0]


def test_node_options_left_out_leave_the_environment_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_NODE_DTYPE", "float32")
    monkeypatch.setenv("TANDEM_NODE_MAX_MODEL_LEN", "2048")
    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://env:1/3")
    s = _node_settings(monkeypatch, "--role", "decode")
    assert (s.dtype, s.max_model_len, s.redis_url, s.role.value) == ("float32", 2048, "redis://env:1/3", "decode")
    s = _node_settings(monkeypatch, "--dtype", "bfloat16", "--redis-url", "redis://flag:1/4", "--tool-call-parser", "")
    assert (s.dtype, s.redis_url, s.tool_call_parser) == ("bfloat16", "redis://flag:1/4", None)


def test_router_options_left_out_leave_the_environment_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr("router.edge.app.create_app", lambda settings: seen.append(settings) or object())
    monkeypatch.setattr("router.edge.server.serve", lambda *a, **kw: None)
    monkeypatch.setenv("TANDEM_ROUTER_POLICY", "round_robin")
    assert CliRunner().invoke(app, ["router"]).exit_code == 0
    assert seen[-1].policy is PolicyName.ROUND_ROBIN
    assert CliRunner().invoke(app, ["router", "--policy", "least_loaded", "--port", "9"]).exit_code == 0
    assert (seen[-1].policy, seen[-1].port) == (PolicyName.LEAST_LOADED, 9)
    result = CliRunner().invoke(app, ["router", "--policy", "fastest"])
    assert result.exit_code == 2 and "fastest" in result.output
