"""The shared cache's default (``infra.shared_cache``): on from four colocated nodes of one model on a host
with the memory for a tier, and what ``tandem up`` starts by it (the cluster itself is not started)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infra import cli as infra_cli
from infra import shared_cache
from infra.shared_cache import MIN_NODES, TIER_MAX, TIER_MIN, default_tier_bytes, shared_cache_default
from tandem.cli import app

GIB = 1 << 30
MIB = 1 << 20


def test_three_nodes_run_without_it_and_four_with_it() -> None:
    three = shared_cache_default(3, tier_bytes=GIB)
    assert (three.host_tier, three.peer_kv) == (None, False)
    four = shared_cache_default(MIN_NODES, tier_bytes=GIB)
    assert (four.host_tier, four.peer_kv) == ("1024MiB", True)
    assert "4 colocated nodes" in four.reason


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"pd_nodes": 2}, "P/D"),
        ({"models": 2}, "several models"),
        ({"connector": "nixl"}, "nixl"),
        ({"tier_bytes": TIER_MIN - MIB}, "memory"),
    ],
)
def test_it_stays_off_where_it_cannot_pay(kwargs: dict, why: str) -> None:
    choice = shared_cache_default(4, **{"tier_bytes": GIB, **kwargs})
    assert (choice.host_tier, choice.peer_kv) == (None, False)
    assert why in choice.reason


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
    assert (spec.host_tier, spec.peer_kv) == (None, False)
    assert "shared cache: off (3 colocated node(s)" in said


def test_the_options_override_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    spec, _ = _up(monkeypatch, "--both", "4", "--host-tier", "off")
    assert (spec.host_tier, spec.peer_kv) == (None, True)
    spec, _ = _up(monkeypatch, "--both", "4", "--no-peer-kv")
    assert (spec.host_tier, spec.peer_kv) == ("512MiB", False)
    spec, said = _up(monkeypatch, "--both", "2", "--host-tier", "1GiB")
    assert (spec.host_tier, spec.peer_kv) == ("1GiB", False)
    assert "peer fetch: off" in said
    spec, _ = _up(monkeypatch, "--both", "2", "--host-tier", "1GiB", "--peer-kv")
    assert (spec.host_tier, spec.peer_kv) == ("1GiB", True)
