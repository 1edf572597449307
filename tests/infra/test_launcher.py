from __future__ import annotations

import pytest

from contracts.registry import Role
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
    monkeypatch.setattr(launcher, "_cores", lambda: cores)
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
    monkeypatch.setattr(launcher, "_cores", lambda: cores)
    assert launcher.assign_cores(Role.BOTH, False, slot, slots) == expected
