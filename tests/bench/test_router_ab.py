"""``python -m bench.router_ab``'s parts that need no engine: arms as given on the command line, the
environment an arm's processes inherit, and the per-request split of two snapshots of a process."""

from __future__ import annotations

import os

import pytest

from bench.procs import ThreadStat, environment
from bench.router_ab import Arm, parse_arm, per_request


def test_an_arm_is_a_router_and_its_environment() -> None:
    assert parse_arm("peer") == Arm("peer", "peer")
    arm = parse_arm("tandem:TANDEM_ROUTER_CPU_PRIORITY=normal+TANDEM_X=a=b")
    assert arm.router == "tandem"
    assert arm.env == (("TANDEM_ROUTER_CPU_PRIORITY", "normal"), ("TANDEM_X", "a=b"))
    with pytest.raises(ValueError, match="router"):
        parse_arm("sglang")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_arm("tandem:TANDEM_X")


def test_an_arms_environment_is_set_for_the_block_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_AB_KEPT", "before")
    monkeypatch.delenv("TANDEM_AB_NEW", raising=False)
    with environment({"TANDEM_AB_KEPT": "during", "TANDEM_AB_NEW": "x"}):
        assert os.environ["TANDEM_AB_KEPT"] == "during" and os.environ["TANDEM_AB_NEW"] == "x"
    assert os.environ["TANDEM_AB_KEPT"] == "before"
    assert "TANDEM_AB_NEW" not in os.environ


def test_per_request_splits_cpu_by_thread_and_counts_switches() -> None:
    before = {10: ThreadStat("python", 1_000_000, 5, 1), 11: ThreadStat("python", 0, 0, 0)}
    after = {
        10: ThreadStat("python", 9_000_000, 21, 5),  # the event loop: 8 ms, 16 wake-ups, 4 preemptions
        11: ThreadStat("python", 2_000_000, 2, 0),
        12: ThreadStat("worker", 1_000_000, 2, 0),  # started between the snapshots
    }
    split = per_request(before, after, pid=10, requests=4)
    assert split["threads_ms"] == {"main": 2.0, "python-11": 0.5, "worker-12": 0.25}
    assert list(split["threads_ms"]) == ["main", "python-11", "worker-12"]  # largest first
    assert split["wakeups"] == 5.0 and split["preemptions"] == 1.0
