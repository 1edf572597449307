"""``tandem bench hosts``'s bookkeeping (bench/hosts.py): the fault schedule, and the summary of a run
whose faults hit hosts (partitions, a host lost) rather than processes. The benchmark itself runs a lab
of real engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import FaultResult, fault_summary
from bench.chaos_report import result_line
from bench.chaos_workload import Request
from bench.hosts import FAULT_NAMES, FAULTS, HostsConfig, run_hosts_bench


def _req(start: float, end: float, outcome: str, rid: str | None = None) -> Request:
    return Request(start=start, end=end, outcome=outcome, response_id=rid)


def test_the_default_schedule_is_every_fault_with_an_injector_and_unknown_ones_are_refused(tmp_path: Path) -> None:
    assert HostsConfig().faults == FAULT_NAMES and set(FAULT_NAMES) == set(FAULTS)
    assert {"cut_decode_host", "cut_prefill_host", "cut_store_host", "lose_decode_host"} <= set(FAULTS)
    with pytest.raises(ValueError, match="lose_region"):
        run_hosts_bench(tmp_path / "out.json", HostsConfig(faults=("lose_region",)))  # before any lab is made
    assert not (tmp_path / "out.json").exists()


def test_a_partitions_failures_are_judged_by_the_host_it_cut() -> None:
    cfg = HostsConfig(faults=("cut_prefill_host", "cut_store_host", "lose_decode_host"), recovery_timeout_s=100)
    results = [
        FaultResult("cut_prefill_host", at_s=10, recovery_s=30, survived=True, target="prefill-8100"),
        FaultResult("cut_store_host", at_s=100, recovery_s=25, survived=True, target="redis"),
        FaultResult("lose_decode_host", at_s=200, recovery_s=None, survived=False, target="decode-8100"),
    ]
    reqs = [
        _req(0, 5, "ok", "a"),
        _req(9, 20, "error event", "pulled-from-prefill"),
        _req(9, 21, "error event", "on-colocated"),
        _req(99, 110, "status 503"),  # a store cut justifies no failure
        _req(120, 130, "ok", "b"),
        _req(199, 201, "error event", "on-decode"),
        _req(199, 250, "hung", "hung-on-decode"),
        _req(199, 400, "cut"),  # after the window (no recovery: timeout 100 + 5 s)
    ]
    nodes_of = {
        "pulled-from-prefill": {"prefill-8100", "decode-8100"},
        "on-colocated": {"colo-8100"},
        "on-decode": {"prefill-8100", "decode-8100"},
        "hung-on-decode": {"decode-8100"},
    }
    s = fault_summary(cfg, 0.0, results, reqs, stranded=0, lost=0, nodes_of=nodes_of)
    assert [r.failed for r in results] == [2, 1, 2]
    # Off its target: a cut prefill host's request that ran on the colocated node, and anything failing
    # while the store is away (the fleet is to serve from its last view).
    assert [r.failed_elsewhere for r in results] == [1, 1, 0]
    assert [r.failed_unattributed for r in results] == [0, 0, 0]
    assert results[2].failed_outcomes == {"error event": 1, "hung": 1}
    assert s["survived"] == 2 and s["hung_streams"] == 1 and s["failed_requests"] == 6
    assert result_line(s) == (
        "RESULT faults=3 survived=2 hung_streams=1 stranded_blocks=0 lost_lake_rows=0 "
        "failed_requests=6 failed_elsewhere=2 recovery_p50_s=27.5 recovery_max_s=30"
    )
