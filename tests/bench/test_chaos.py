"""The chaos benchmark's bookkeeping (bench/chaos.py): timeline bins, per-fault failure windows, the
summary and RESULT line, and the plot. The benchmark itself runs real engines (`tandem bench chaos`)."""

from __future__ import annotations

from pathlib import Path

from bench.chaos import Chaos, ChaosConfig, FaultResult, _leased
from bench.chaos_report import plot, result_line, timeline
from bench.chaos_workload import Request


def _req(start: float, end: float, outcome: str, rid: str | None = None) -> Request:
    return Request(start=start, end=end, outcome=outcome, response_id=rid)


def test_timeline_bins_answers_and_failures_by_end_time() -> None:
    reqs = [_req(0, 1, "ok"), _req(0, 4.9, "ok"), _req(3, 6, "status 502"), _req(5, 7, "running")]
    tl = timeline(reqs, t0=0.0, t_end=9.0, bin_s=5.0)
    assert tl == [
        {"t_s": 0.0, "answers_per_s": 0.4, "failures_per_s": 0.0},
        {"t_s": 5.0, "answers_per_s": 0.0, "failures_per_s": 0.2},
    ]


def test_leased_blocks_are_summed_over_engines_samples() -> None:
    text = (
        '# HELP tandem_kv_leased_blocks x\ntandem_kv_leased_blocks{engine="0"} 3.0\n'
        'tandem_kv_leased_blocks{engine="1"} 2.0\ntandem_kv_leases_active 1.0\n'
    )
    assert _leased(text) == 5


def test_summary_counts_failures_inside_each_faults_window_and_the_result_line(tmp_path: Path) -> None:
    cfg = ChaosConfig(faults=("sigkill_router", "restart_redis"), recovery_timeout_s=100)
    chaos = Chaos.__new__(Chaos)  # bookkeeping only: no cluster
    chaos.t0, chaos.events = 1000.0, []
    results = [
        FaultResult("sigkill_router", target="router", at_s=10, recovery_s=20, survived=True),
        FaultResult("restart_redis", target="redis", at_s=60, recovery_s=None, survived=False),
    ]
    reqs = [
        _req(1000, 1005, "ok", "a"),
        _req(1009, 1012, "cut"),
        _req(1012, 1034, "status 503"),
        _req(1030, 1036, "hung"),
        _req(1061, 1070, "status 502"),
        _req(1050, 1055, "ok", "b"),
    ]
    doc = chaos.summarise(cfg, results, reqs, t_end=1200.0, stranded=0, lost=1, answered=2)
    s = doc["summary"]
    assert [f["failed"] for f in doc["faults"]] == [2, 1]  # window: fault .. recovery + 5 s
    assert doc["faults"][0]["failed_outcomes"] == {"cut": 1, "status 503": 1}
    assert s["survived"] == 1 and s["hung_streams"] == 1 and s["failed_requests"] == 4
    assert s["recovery_p50_s"] == 20 and s["recovery_max_s"] == 20
    # A killed router cuts its own streams; a 503 from the surviving replica, and anything failing
    # while Redis restarts, was not on the component that died.
    assert [f["failed_elsewhere"] for f in doc["faults"]] == [1, 1] and s["failed_elsewhere"] == 2
    assert result_line(s) == (
        "RESULT faults=2 survived=1 hung_streams=1 stranded_blocks=0 lost_lake_rows=1 "
        "failed_requests=4 failed_elsewhere=2 recovery_p50_s=20 recovery_max_s=20"
    )
    png = tmp_path / "chaos.png"
    plot(doc, png)
    assert png.stat().st_size > 10_000


def test_a_node_faults_failures_are_judged_by_the_nodes_their_lake_rows_name() -> None:
    cfg = ChaosConfig(faults=("sigkill_decode_engine",), recovery_timeout_s=100)
    chaos = Chaos.__new__(Chaos)
    chaos.t0, chaos.events = 0.0, []
    results = [FaultResult("sigkill_decode_engine", target="decode-1", at_s=10, recovery_s=30, survived=True)]
    reqs = [
        _req(5, 12, "error event", "on-decode"),
        _req(6, 13, "error event", "on-colocated"),
        _req(7, 14, "status 503"),  # no id: nothing tells where it was
        _req(8, 15, "ok", "fine"),
    ]
    nodes_of = {"on-decode": {"prefill-0", "decode-1"}, "on-colocated": {"both-2"}}
    doc = chaos.summarise(cfg, results, reqs, t_end=60.0, stranded=0, lost=0, answered=1, nodes_of=nodes_of)
    [fault] = doc["faults"]
    assert fault["failed"] == 3 and fault["failed_elsewhere"] == 1 and fault["failed_unattributed"] == 1
    assert doc["summary"]["failed_elsewhere"] == 1
