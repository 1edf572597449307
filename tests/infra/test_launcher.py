from __future__ import annotations

import json

import pytest

from contracts.errors import ConfigError
from contracts.registry import Role
from infra import cores as placement
from infra import launcher


@pytest.mark.parametrize(
    ("cores", "role", "has_pd", "expected"),
    [
        ([0, 1], Role.PREFILL, True, "0"),
        ([0, 1], Role.DECODE, True, "1"),
        ([0, 1], Role.BOTH, True, "1"),  # beside a P/D pair: never spread over cores others compute on
        ([0, 1], Role.BOTH, False, "0-1"),
        ([0, 1, 2, 3], Role.PREFILL, True, "0-1"),
        ([0, 1, 2, 3], Role.DECODE, True, "2-3"),
        ([5], Role.DECODE, True, "5"),
    ],
)
def test_assign_cores(
    monkeypatch: pytest.MonkeyPatch, cores: list[int], role: Role, has_pd: bool, expected: str
) -> None:
    monkeypatch.setattr(placement, "_cores", lambda: cores)
    assert launcher.assign_cores(role, has_pd) == expected


@pytest.mark.parametrize(
    ("cores", "slot", "slots", "expected"),
    [
        ([0, 1], 0, 2, "0"),  # two colocated nodes on two cores: one each, never spread over both
        ([0, 1], 1, 2, "1"),
        ([0, 1, 2, 3], 1, 2, "2-3"),
        ([0, 1], 2, 3, "0"),  # more nodes than cores: they share, one core each
        ([0, 1], 0, 1, "0-1"),
    ],
)
def test_colocated_nodes_split_the_cores(
    monkeypatch: pytest.MonkeyPatch, cores: list[int], slot: int, slots: int, expected: str
) -> None:
    monkeypatch.setattr(placement, "_cores", lambda: cores)
    assert launcher.assign_cores(Role.BOTH, False, slot, slots) == expected


def _started(monkeypatch: pytest.MonkeyPatch, spec: launcher.ClusterSpec) -> dict[str, tuple[list[str], dict]]:
    """What ``Cluster.start`` would run: name -> (tandem arguments, extra environment); nothing starts."""
    started: dict[str, tuple[list[str], dict]] = {}
    monkeypatch.setattr(launcher, "reachable", lambda url: True)
    monkeypatch.setattr(placement, "_cores", lambda: [0, 1])

    def spawn(self: launcher.Cluster, name: str, args: list[str], env: dict | None = None) -> None:
        started[name] = (args, env or {})

    monkeypatch.setattr(launcher.Cluster, "_spawn", spawn)
    launcher.Cluster(spec).start()
    return started


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_a_models_file_starts_nodes_per_served_model_and_reaches_the_routers(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    models = tmp_path / "models.toml"
    models.write_text('[served.a]\ndtype = "float32"\n[served.b]\npath = "/m/b"\n[aliases]\nsmall = "a"\n')
    spec = launcher.ClusterSpec(
        prefill=0,
        decode=0,
        both=1,
        models=launcher.models_from_file(models),
        models_file=models,
        redis_url="redis://127.0.0.1:1/0",
        dtype="bfloat16",
        routers=1,
        workdir=tmp_path,
    )
    started = _started(monkeypatch, spec)
    nodes = {name: args for name, (args, _) in started.items() if args[0] == "node"}
    assert sorted(nodes) == ["both-0-8100", "both-1-8110"]
    a, b = nodes["both-0-8100"], nodes["both-1-8110"]
    assert (_flag(a, "--served-model-name"), _flag(a, "--model"), _flag(a, "--dtype")) == ("a", None, "float32")
    assert (_flag(b, "--served-model-name"), _flag(b, "--model"), _flag(b, "--dtype")) == ("b", "/m/b", "bfloat16")
    assert (_flag(a, "--cores"), _flag(b, "--cores")) == ("0", "1")  # one core each, as two colocated nodes
    assert started["router"][1]["TANDEM_ROUTER_MODELS"] == str(models.resolve())


def test_one_model_starts_as_before(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    spec = launcher.ClusterSpec(
        prefill=1, decode=1, model="/m/x", redis_url="redis://127.0.0.1:1/0", routers=1, workdir=tmp_path
    )
    started = _started(monkeypatch, spec)
    nodes = [args for args, _ in started.values() if args[0] == "node"]
    assert [(_flag(n, "--model"), _flag(n, "--served-model-name")) for n in nodes] == [("/m/x", None)] * 2
    assert "TANDEM_ROUTER_MODELS" not in started["router"][1]


def test_model_options_are_checked() -> None:
    assert launcher.parse_model_option("a=") == launcher.ModelSpec("a", None)
    assert launcher.parse_model_option(" b = /m/b ") == launcher.ModelSpec("b", "/m/b")
    with pytest.raises(ConfigError, match="expected NAME=PATH"):
        launcher.parse_model_option("=/m/b")
    twice = launcher.ClusterSpec(models=(launcher.ModelSpec("a"), launcher.ModelSpec("a")))
    with pytest.raises(ConfigError, match="served model names must differ"):
        _ = twice.nodes


def test_the_host_tier_emits_its_lake_rows_where_the_lake_writer_reads(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    config = '{"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": 3}'
    (model / "config.json").write_text(config)
    spec = launcher.ClusterSpec(
        prefill=0,
        decode=0,
        both=1,
        model=str(model),
        dtype="float32",
        block_size=32,
        host_tier="1MiB",
        redis_url="redis://127.0.0.1:1/4",
        routers=1,
        workdir=tmp_path,
    )
    started = _started(monkeypatch, spec)
    assert started["host-tier"][1]["TANDEM_TIER_TELEMETRY_REDIS_URL"] == "redis://127.0.0.1:1/4"
    assert _flag(started["lake-writer"][0], "--redis-url") == "redis://127.0.0.1:1/4"


@pytest.mark.parametrize(("cores", "replicas"), [([0], 1), ([0, 1], 1), ([0, 1, 2, 3], 2)])
def test_a_small_host_runs_one_router_replica_by_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path, cores: list[int], replicas: int
) -> None:
    spec = launcher.ClusterSpec(both=2, model="/m/x", redis_url="redis://127.0.0.1:1/0", workdir=tmp_path)
    started = _started(monkeypatch, spec)
    monkeypatch.setattr(placement, "_cores", lambda: cores)  # _started pins two cores while starting
    assert spec.router_count == replicas
    assert [n for n in started if n.startswith("router")] == ["router"]  # two cores while starting
    assert launcher.ClusterSpec(routers=3).router_count == 3  # as told


def test_every_router_replica_warms_the_models_the_nodes_serve(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    spec = launcher.ClusterSpec(both=2, model="/m/x", redis_url="redis://127.0.0.1:1/0", routers=2, workdir=tmp_path)
    started = _started(monkeypatch, spec)
    for name in ("router", "router-1"):
        assert json.loads(started[name][1]["TANDEM_ROUTER_WARM_MODELS"]) == ["/m/x"]
    default = launcher.ClusterSpec(both=1, workdir=tmp_path).model_paths
    assert default == [str(launcher.default_model_dir())]
