"""The fleet bench's summaries and targets, from hand-made runs (no engine, no router)."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench.fleet import (
    ARMS,
    BASELINE,
    TIER_CHECK,
    FleetBenchConfig,
    RunRecord,
    fresh_arm_state,
    plain_env,
    requests_of,
    result_line,
    round_plan,
    summarize,
    targets,
)
from bench.histograms import diff_buckets, histogram_quantile, parse_histogram
from bench.loadgen import RequestResult, SentRequest, SessionScript, run_sessions
from bench.procs import outside_cpu_s
from bench.standin_engine import ServerThread, StandInEngine
from contracts.registry import Role
from kv_transfer import ENGINE_HOOKS
from node_agent.settings import NodeSettings

METRICS = """\
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.05",model_name="m"} 0.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1",model_name="m"} 10.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.2",model_name="m"} 30.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 40.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 40.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 99.0
"""


def test_a_histogram_is_read_from_vllms_metrics_page_and_its_median_interpolated() -> None:
    buckets, total, count = parse_histogram(METRICS, "vllm:inter_token_latency_seconds")
    assert buckets == {0.05: 0.0, 0.1: 10.0, 0.2: 30.0, math.inf: 40.0}
    assert (total, count) == (6.0, 40.0)
    # rank 20 of 40 falls half-way into (0.1, 0.2], which holds counts 10..30
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.15)
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.2)  # in +Inf: its lower bound
    assert math.isnan(histogram_quantile({}, 0.5))
    before = {0.05: 0.0, 0.1: 10.0, 0.2: 10.0, math.inf: 10.0}
    assert diff_buckets(before, buckets) == {0.05: 0.0, 0.1: 0.0, 0.2: 20.0, math.inf: 30.0}


def _sent(session: str, turn: int, ok: bool = True, ttft: float = 0.5, cached: int = 50) -> SentRequest:
    result = RequestResult(
        ok=ok,
        ttft_s=ttft,
        e2e_s=ttft + 1.0,
        itl_s=[0.1, 0.2] if ok else [],
        usage={"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": cached}} if ok else None,
    )
    return SentRequest(session, turn, 0.0, 0.0, result)


def _run(arm: str, rnd: int, sent: list[SentRequest], wall: float = 60.0, cpu: float = 1.0) -> RunRecord:
    return RunRecord(
        arm=arm,
        round=rnd,
        sent=sent,
        sessions=len({s.session_id for s in sent}),
        wall_s=wall,
        engine_itl_buckets={0.1: 2.0, 0.2: 4.0, math.inf: 4.0},
        engine_itl_sum_s=0.5,
        non_engine_cpu_s={"router": cpu},
    )


def test_an_arms_runs_pool_their_requests_and_a_failed_turn_loses_its_session() -> None:
    r0 = _run("tandem", 0, [_sent("a", 0), _sent("a", 1), _sent("b", 0, ttft=2.0, cached=0)])
    r1 = _run("tandem", 1, [_sent("a", 0), _sent("c", 0, ok=False)], wall=30.0, cpu=0.5)
    s = summarize([r0, r1])
    assert (s["requests"], s["errors"]) == (5, 1)
    assert s["sessions_completed"] == 3  # a, b in round 0; a in round 1 (c failed)
    assert s["sessions_per_min"] == pytest.approx(3 / 90 * 60, abs=0.01)
    assert s["hit"] == pytest.approx(150 / 400)
    assert s["ttft_p50_ms"] == pytest.approx(500.0)
    assert s["client_itl_p50_ms"] == pytest.approx(150.0)
    assert s["engine_itl_p50_ms"] == pytest.approx(100.0)  # 8 gaps over 2 runs: the 4th is the 0.1 bound
    assert s["engine_itl_mean_ms"] == pytest.approx(125.0)
    assert s["path_itl_p50_ms"] == pytest.approx(50.0)
    assert s["non_engine_cpu_s"] == pytest.approx(1.5)


def test_a_runs_requests_are_listed_in_the_order_sent_with_turn_ttft_and_cache() -> None:
    late = SentRequest("b", 0, 2.0, 0.0, RequestResult(ok=False, error="boom"))
    early = _sent("a", 1, ttft=1.25, cached=64)
    rows = requests_of(_run("tandem", 0, [late, early]))
    assert [(r["session"], r["turn"], r["ok"]) for r in rows] == [("a", 1, True), ("b", 0, False)]
    assert rows[0]["ttft_ms"] == 1250.0 and rows[0]["cached_tokens"] == 64 and rows[0]["prompt_tokens"] == 100
    assert rows[1]["cached_tokens"] == 0 and rows[1]["sent_s"] == 2.0


def _arm(spm: float, itl: float, ttft99: float, hit: float) -> dict:
    return {"sessions_per_min": spm, "client_itl_p50_ms": itl, "ttft_p99_ms": ttft99, "hit": hit}


def test_targets_hold_and_miss_at_their_bounds() -> None:
    base = _arm(10.0, 100.0, 2000.0, 0.75)
    held = targets({"tandem": _arm(11.0, 105.0, 1600.0, 0.78), BASELINE: base, "tandem_tier": _arm(11.3, 1, 1, 1)})
    assert all(t["held"] for t in held.values()), held
    assert len(held) == 5
    missed = targets({"tandem": _arm(10.9, 105.1, 1601.0, 0.779), BASELINE: base, "tandem_tier": _arm(11.4, 1, 1, 1)})
    assert not any(t["held"] for t in missed.values()), missed
    assert targets({"tandem": base}) == {}  # nothing to compare with: no target is judged
    line = result_line({"config": {"nodes": 2}, "arms": {"tandem": base}, "targets": missed})
    assert line.startswith("RESULT fleet nodes=2 targets_held=0/5 ")
    assert "missed=" in line


def test_the_tier_check_reads_every_round_of_the_two_tandem_arms_and_the_rest_the_main_rounds() -> None:
    base = _arm(10.0, 100.0, 2000.0, 0.75)
    main = {"tandem": _arm(11.0, 105.0, 1600.0, 0.78), BASELINE: base, "tandem_tier": _arm(12.0, 1, 1, 1)}
    assert targets(main)[TIER_CHECK]["held"] is False  # 11.0 < 0.97 x 12.0 over the main rounds alone
    pooled = {"tandem": {**main["tandem"], "sessions_per_min": 11.9}, "tandem_tier": main["tandem_tier"]}
    held = targets(main, pooled)
    assert held[TIER_CHECK] == {"value": 11.9, "bound": 11.64, "held": True}
    assert held["sessions_per_min >= 1.10 x vllm-router"]["value"] == 11.0  # (the main rounds' figure)
    pooled["tandem"]["runs"], pooled["tandem_tier"]["runs"] = 6, 6
    line = result_line({"config": {"nodes": 2}, "arms": main, "tandem_pooled": pooled, "targets": held})
    assert "pooled:tandem=11.9/6,tandem_tier=12.0/6" in line and "missed=" not in line


def test_extra_rounds_run_the_two_tandem_arms_alone_in_alternating_order() -> None:
    plan = round_plan(FleetBenchConfig(rounds=2, tier_rounds=3))
    assert plan == [
        (0, ARMS),
        (1, ARMS[::-1]),
        (2, ("tandem", "tandem_tier")),
        (3, ("tandem_tier", "tandem")),
        (4, ("tandem", "tandem_tier")),
    ]
    # without both Tandem arms there is nothing to pool: no extra round
    only = round_plan(FleetBenchConfig(rounds=1, arms=("tandem", BASELINE), tier_rounds=3))
    assert only == [(0, ("tandem", BASELINE))]


def test_a_plain_engine_runs_the_nodes_command_environment_without_tandems_hooks() -> None:
    env = plain_env(NodeSettings(role=Role.BOTH, cores="0", engine_auth=False))
    assert str(ENGINE_HOOKS) not in env["PYTHONPATH"].split(":")
    assert "TANDEM_ENGINE_SPIN_MS" not in env and "TANDEM_NIXL_PROGRESS_THREAD" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"


@pytest.mark.parametrize("max_sessions", [1, 2])
def test_an_agent_pool_runs_at_most_its_size_of_sessions_at_once(max_sessions: int) -> None:
    """All sessions arrive at once; each starts only when a slot is free, and its wait counts as late."""
    engine = StandInEngine(stream_tokens=3)
    scripts = [
        SessionScript(session_id=f"s{i}", start_s=0.0, turns=[[{"role": "user", "content": f"t{i}"}]] * 2, think_s=[0])
        for i in range(4)
    ]
    with ServerThread(engine.app) as url:
        sent = asyncio.run(run_sessions(url, "m", scripts, 3, max_sessions=max_sessions))
    assert all(s.result.ok for s in sent) and len(sent) == 8
    spans = {}
    for s in sent:
        lo, hi = spans.get(s.session_id, (math.inf, -math.inf))
        spans[s.session_id] = (min(lo, s.sent_s), max(hi, s.sent_s + s.result.e2e_s))
    # at no session's start were more than max_sessions sessions running (itself included)
    for start, _ in spans.values():
        assert sum(lo <= start < hi for lo, hi in spans.values()) <= max_sessions
    assert sum(s.late_s > 0 for s in sent) >= len(scripts) - max_sessions


def test_outside_cpu_leaves_out_what_this_process_and_its_children_burn() -> None:
    def busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - t.iowait - t.guest - t.guest_nice

    burn = (
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"
        "print(flush=True)\ntime.sleep(60)"
    )
    host, outside = busy(), outside_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline()  # the burn is done, the child still alive
        host, outside = busy() - host, outside_cpu_s() - outside
    finally:
        child.kill()
        child.wait()
    assert host - outside >= 0.5  # the child's half second (and this process's own) is not outside


def test_an_arms_cluster_folder_and_router_database_start_empty(tmp_path: Path) -> None:
    """A second run's arm must not find the first run's lake rows or stored responses."""
    old_lake = tmp_path / "cluster-r0-tandem" / "lake" / "requests"
    old_lake.mkdir(parents=True)
    (old_lake / "part-0.parquet").write_bytes(b"rows of an earlier run")
    (tmp_path / "router-r0-tandem.db").write_bytes(b"responses of an earlier run")
    other = tmp_path / "cluster-r1-tandem"
    other.mkdir()
    cluster, db = fresh_arm_state(tmp_path, "r0-tandem")
    assert (cluster, db) == (tmp_path / "cluster-r0-tandem", tmp_path / "router-r0-tandem.db")
    assert not cluster.exists() and not db.exists()
    assert other.exists()  # another arm's folder is left alone
