"""One source for each setting: ``TANDEM_REDIS_URL`` is every process's Redis, and a CLI option left out
leaves the process's own setting (``TANDEM_NODE_*``, ``TANDEM_ROUTER_*``) in force instead of overriding
it with a default of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from contracts.config import DEFAULT_REDIS_URL, lake_dir, redis_url, shared_settings
from contracts.secret import default_secret_path, load_cluster_secret
from node_agent.model import tandem_home
from node_agent.settings import NodeSettings
from router.admission.context import AdmissionSettings
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


def test_the_shared_variables_are_read_by_one_class(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The cluster secret, the model home, the hash seed and the lake come from ``SharedSettings`` alone;
    an empty variable counts as unset, as ``os.environ.get(...) or default`` did."""
    monkeypatch.setenv("TANDEM_CLUSTER_SECRET", "s" * 40)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setenv("PYTHONHASHSEED", "4242")
    monkeypatch.setenv("TANDEM_LAKE_DIR", "")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("TANDEM_CLUSTER", "blue")
    env = shared_settings()
    assert env.cluster_secret is not None and env.cluster_secret.get_secret_value() == "s" * 40
    assert "s" * 40 not in repr(env)  # a settings dump in a log shows no secret
    assert (env.home, env.hash_seed, env.lake_dir) == (tmp_path, "4242", None)
    assert tandem_home() == tmp_path
    assert lake_dir(workdir=tmp_path).path == tmp_path / "lake"
    assert load_cluster_secret(loopback_only=False) == b"s" * 40
    assert default_secret_path() == tmp_path / "state" / "tandem" / "cluster-secret-blue"


def test_kv_faults_is_a_node_setting_under_its_old_name_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_NODE_KV_FAULTS", raising=False)
    monkeypatch.delenv("TANDEM_KV_FAULTS", raising=False)
    assert not NodeSettings().kv_faults and "faults" not in NodeSettings().kv_connector_extra
    monkeypatch.setenv("TANDEM_KV_FAULTS", "1")  # the name before it was the node's
    assert NodeSettings().kv_faults
    monkeypatch.delenv("TANDEM_KV_FAULTS")
    monkeypatch.setenv("TANDEM_NODE_KV_FAULTS", "true")
    assert NodeSettings().kv_connector_extra["faults"] is True
    assert NodeSettings(kv_faults=False).kv_connector_extra.get("faults") is None


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


def test_the_router_process_has_one_settings_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """``RouterSettings`` is the root: its admission section is read in the same build under the names
    users know, shares the root's Redis URL and cluster, and the node slots are the router's settings
    under names that say so, the old names still read."""
    for name in ("TANDEM_ROUTER_NODE_MAX_QUEUE", "TANDEM_ROUTER_NODE_MAX_CONCURRENCY", "TANDEM_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TANDEM_AUTH", "required")
    monkeypatch.setenv("TANDEM_NODE_MAX_QUEUE", "7")  # the deprecated name
    monkeypatch.setenv("TANDEM_ROUTER_NODE_MAX_CONCURRENCY", "3")
    monkeypatch.setenv("TANDEM_TENANT_MAX_STREAMS_OVERRIDES", '{"acme": 2}')
    monkeypatch.setenv("TANDEM_ROUTER_POLICY", "round_robin")
    settings = RouterSettings()
    adm = settings.admission
    assert settings.policy is PolicyName.ROUND_ROBIN
    assert (adm.auth, adm.node_max_queue, adm.node_max_concurrency) == ("required", 7, 3)
    assert adm.tenant_max_streams_overrides == {"acme": 2}
    assert adm.redis_url == settings.redis_url == DEFAULT_REDIS_URL
    given = RouterSettings(redis_url="redis://given:1/2", cluster="blue")  # as `--redis-url` gives it
    assert (given.admission.redis_url, given.admission.cluster) == ("redis://given:1/2", "blue")
    assert given.admission.auth == "required"  # the rest of the section still from the environment
    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://env:1/3")
    assert RouterSettings().admission.redis_url == "redis://env:1/3"
    assert AdmissionSettings.from_env().node_max_queue == 7  # `tandem keys` reads the same section
    with pytest.raises(ValidationError):
        AdmissionSettings(no_such_setting=1)  # type: ignore[call-arg]
