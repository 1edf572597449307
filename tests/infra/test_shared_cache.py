"""The shared cache's default (``infra.shared_cache``): peer KV from two colocated nodes of one model, the host
tier too from four on a host with the memory for it, and what ``tandem up`` starts by it (the cluster
itself is not started)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infra import cli as infra_cli
from infra import shared_cache
from infra.shared_cache import MIN_NODES, TIER_MAX, TIER_MIN, default_tier_bytes, shared_cache_default
from tandem.cli import app

GIB = 1 << 30
MIB = 1 << 20


def test_one_node_runs_without_it_two_and_three_with_peer_kv_and_four_with_the_tier_too() -> None:
    one = shared_cache_default(1, tier_bytes=GIB)
    assert (one.host_tier, one.peer_kv) == (None, False)
    for n in (2, 3):
        some = shared_cache_default(n, tier_bytes=GIB)
        assert (some.host_tier, some.peer_kv) == (None, True)
        assert "host tier off" in some.reason
    four = shared_cache_default(MIN_NODES, tier_bytes=GIB)
    assert (four.host_tier, four.peer_kv) == ("1024MiB", True)
    assert "4 colocated nodes" in four.reason


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"pd_nodes": 2}, "P/D"),
        ({"models": 2}, "several models"),
        ({"connector": "nixl"}, "nixl"),
    ],
)
def test_it_stays_off_where_it_cannot_pay(kwargs: dict, why: str) -> None:
    choice = shared_cache_default(4, **{"tier_bytes": GIB, **kwargs})
    assert (choice.host_tier, choice.peer_kv) == (None, False)
    assert why in choice.reason


def test_without_the_memory_for_a_tier_peer_kv_stays_on() -> None:
    choice = shared_cache_default(4, tier_bytes=TIER_MIN - MIB)
    assert (choice.host_tier, choice.peer_kv) == (None, True)
    assert "memory" in choice.reason


@pytest.mark.parametrize(
    ("available", "shm_free", "size"),
    [
        (24 * GIB, 12 * GIB, TIER_MAX),  # capped
        (2 * GIB, 12 * GIB, 256 * MIB),  # an eighth of the memory available
        (24 * GIB, 600 * MIB, 300 * MIB),  # half of /dev/shm's free space
        (GIB, 12 * GIB, 0),  # 128 MiB: under the smallest tier measured to pay
        (2 * GIB + 12345, 12 * GIB, 256 * MIB),  # whole MiB
    ],
)
def test_the_default_tier_is_sized_from_the_memory_free(available: int, shm_free: int, size: int) -> None:
    assert default_tier_bytes(available, shm_free) == size


def _up(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[object, str]:
    """The spec ``tandem up ARGS`` would start, and what it printed."""
    started = []
    monkeypatch.setattr(infra_cli, "_run_cluster", lambda cluster, *_: started.append(cluster.spec))
    monkeypatch.setattr(shared_cache, "default_tier_bytes", lambda: 512 * MIB)
    result = CliRunner().invoke(app, ["up", "--prefill", "0", "--decode", "0", *args])
    assert result.exit_code == 0, result.output
    return started[0], result.output


def test_tandem_up_turns_it_on_by_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    spec, said = _up(monkeypatch, "--both", "4")
    assert (spec.host_tier, spec.peer_kv) == ("512MiB", True)
    assert "shared cache: on (4 colocated nodes: 512 MiB host tier)" in said
    spec, said = _up(monkeypatch, "--both", "3")
    assert (spec.host_tier, spec.peer_kv) == (None, True)
    assert "shared cache: peer KV on, host tier off (3 colocated nodes" in said
    spec, said = _up(monkeypatch, "--both", "1")
    assert (spec.host_tier, spec.peer_kv) == (None, False)
    assert "shared cache: off (1 colocated node(s)" in said


def test_the_options_override_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    spec, _ = _up(monkeypatch, "--both", "4", "--host-tier", "off")
    assert (spec.host_tier, spec.peer_kv) == (None, True)
    spec, _ = _up(monkeypatch, "--both", "4", "--no-peer-kv")
    assert (spec.host_tier, spec.peer_kv) == ("512MiB", False)
    spec, said = _up(monkeypatch, "--both", "2", "--host-tier", "1GiB")
    assert (spec.host_tier, spec.peer_kv) == ("1GiB", True)
    assert "peer fetch: on" in said
    spec, said = _up(monkeypatch, "--both", "1", "--host-tier", "1GiB")
    assert (spec.host_tier, spec.peer_kv) == ("1GiB", False)
    assert "peer fetch: off" in said
    spec, _ = _up(monkeypatch, "--both", "2", "--host-tier", "1GiB", "--peer-kv")
    assert (spec.host_tier, spec.peer_kv) == ("1GiB", True)
