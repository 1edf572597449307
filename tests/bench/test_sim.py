"""``tandem bench sim`` without engines: the sim-against-real comparison (errors per metric, the ranking
check, the RESULT line), the real fleet's simulated twin (``sim_specs``), and the simulated half of a
recorded run (``compare``) from canned real figures and profiles."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from bench.sim import LiveNodeView, compare, sim_specs
from bench.sim_compare import errors, plan_matches_real, render, result_line
from contracts.errors import ConfigError
from contracts.registry import Role
from router.policies import CacheAware
from simulator.fleet import FleetSim, NodeSpec
from simulator.report import summarize
from simulator.step_model import Profile, StepModel
from traces.synth import AgenticSpec, synth_agentic

REAL = {
    "pd": {"ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "itl_p50_s": 0.1, "output_tok_s": 50.0, "observed_hit": 0.5},
    "colocated": {"ttft_p50_s": 0.8, "ttft_p90_s": 1.5, "itl_p50_s": 0.12, "output_tok_s": 55.0, "observed_hit": 0.6},
}


def test_errors_and_the_result_line():
    sim = {
        "pd": {"ttft_p50_s": 1.1, "ttft_p90_s": 1.8, "itl_p50_s": 0.1, "output_tok_s": 40.0, "observed_hit": 0.45},
        "colocated": {
            "ttft_p50_s": 0.8,
            "ttft_p90_s": 1.2,
            "itl_p50_s": 0.15,
            "output_tok_s": 55.0,
            "observed_hit": 0.6,
        },
    }
    per = {name: errors(REAL[name], sim[name]) for name in REAL}
    assert abs(per["pd"].ttft_p50 - 0.1) < 1e-9 and abs(per["pd"].tput - 0.2) < 1e-9
    assert abs(per["pd"].hit - 0.05) < 1e-9 and abs(per["colocated"].itl_p50 - 0.25) < 1e-9
    assert plan_matches_real(REAL, sim)
    line = result_line(per, plan_matches_real(REAL, sim))
    assert line == (
        "RESULT ttft_p50_err=0.100 ttft_p90_err=0.200 itl_p50_err=0.250 tput_err=0.200 hit_err=0.050 "
        "plan_matches_real=1"
    )
    swapped = {"pd": sim["colocated"], "colocated": sim["pd"]}
    assert not plan_matches_real(REAL, swapped)


def test_a_simulated_summary_has_the_replays_fields():
    trace = synth_agentic(AgenticSpec(sessions=5, seed=1, system_tokens=256, max_input_tokens=3000))
    sim = FleetSim([NodeSpec(Role.BOTH), NodeSpec(Role.BOTH)], lambda lookup: CacheAware(lookup))
    s = asdict(summarize(sim, sim.run(trace)))
    assert s["label"] == "SIMULATED" and s["requests"] == len(trace)
    assert 0 < s["ttft_p50_s"] <= s["ttft_p90_s"] and s["itl_p50_s"] > 0 and 0 <= s["observed_hit"] < 1
    assert errors(s, s).ttft_p90 == 0.0


def _node(node_id: str, role: Role, blocks: int = 700) -> LiveNodeView:
    return LiveNodeView(node_id, role, f"http://127.0.0.1/{node_id}", blocks, 32)


def test_the_simulated_twin_copies_each_nodes_role_cache_and_token_budget():
    specs = sim_specs([_node("prefill-0", Role.PREFILL, 728), _node("decode-1", Role.DECODE, 650)], 8192)
    assert [(s.role, s.num_blocks, s.block_size) for s in specs] == [(Role.PREFILL, 728, 32), (Role.DECODE, 650, 32)]
    # the nodes' own engine arguments: a prefill node batches 4096 tokens a step, a decode node 2048
    assert [s.max_batched_tokens for s in specs] == [4096, 2048]
    # a colocated node passes none: vLLM's CPU server default
    assert sim_specs([_node("both-0", Role.BOTH)], 8192)[0].max_batched_tokens == 2048
    # a short context window caps the role's budget as the node's arguments do
    assert sim_specs([_node("prefill-0", Role.PREFILL)], 1024)[0].max_batched_tokens == 1024
    with pytest.raises(ConfigError, match="not reported"):
        sim_specs([_node("both-0", Role.BOTH, blocks=0)], 8192)


def _arm(roles: list[Role], step: StepModel, real: dict[str, float]) -> dict:
    nodes = [_node(f"{r.value}-{i}", r) for i, r in enumerate(roles)]
    return {
        "nodes": [{**asdict(n), "role": n.role.value} for n in nodes],
        "max_model_len": 8192,
        "profile": json.loads(Profile(models={r: step for r in set(roles)}, description="canned").to_json()),
        "real": {**real, "requests": 10, "ok": 10},
    }


def test_the_simulated_half_of_a_recorded_run(tmp_path):
    trace = synth_agentic(
        AgenticSpec(
            sessions=6, seed=5, system_tokens=256, repo_tokens=(128, 512), output_tokens=(8, 16), max_input_tokens=1500
        )
    )
    slow = StepModel(base_s=0.04, prefill_s_per_token=0.002, decode_s_per_seq=0.002, request_overhead_s=0.01)
    fast = StepModel(base_s=0.01, prefill_s_per_token=0.0005, decode_s_per_seq=0.001, request_overhead_s=0.01)
    arms = {
        "pd": _arm([Role.PREFILL, Role.DECODE], slow, REAL["pd"]),
        "colocated": _arm([Role.BOTH, Role.BOTH], fast, REAL["colocated"]),
    }
    out = compare(arms, trace, tmp_path, heartbeat_s=2.0)
    for a in arms.values():
        assert a["sim"]["label"] == "SIMULATED" and a["sim"]["requests"] == len(trace)
        assert len(a["sim_requests"]) == len(trace) and set(a["errors"]) == {
            "ttft_p50",
            "ttft_p90",
            "itl_p50",
            "tput",
            "hit",
        }
        assert a["errors"]["hit"] == pytest.approx(abs(a["sim"]["observed_hit"] - a["real"]["observed_hit"]))
    # every step of the pd arm's nodes is slower, so the simulator ranks colocated first, as REAL does
    assert arms["colocated"]["sim"]["ttft_p90_s"] < arms["pd"]["sim"]["ttft_p90_s"]
    assert out["plan_matches_real"] is True
    assert out["result"].startswith("RESULT ttft_p50_err=") and out["result"].endswith("plan_matches_real=1")
    assert "SIMULATED" in render(arms)
    # a record without the real routes (runs before 2026-12-04) gets no agreement figure; the simulated
    # rows name each route as the real ones do
    assert "routes_agree" not in arms["pd"] and {r["route"] for r in arms["colocated"]["sim_requests"]} <= {
        "both-0",
        "both-1",
    }
    # the local-prefill rule of the real policy sends some later turns whole to the decode node
    modes = {r["mode"] for r in arms["pd"]["sim_requests"]}
    assert "disaggregated" in modes


def test_the_real_routes_come_from_the_lake_in_the_simulators_node_names(tmp_path):
    """The lake's rows of a session, in arrival order, are the replay's requests of that session in the
    order sent; node ids become the simulator's names (node i of the list is ``{role}-{i}``); a session
    the lake holds only in part is left out, and so is another run's."""
    import datetime as dt

    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.sim_compare import real_routes, routes_agree
    from telemetry.schemas import SCHEMAS

    t = dt.datetime(2026, 12, 4, 9, 0, tzinfo=dt.UTC)
    rows = [  # (session, seconds after t, prefill node, decode node); written out of order
        ("run-a-s0", 5.0, None, "decode-1-19720"),
        ("run-a-s0", 0.0, "prefill-0-19710", "decode-1-19720"),
        ("run-a-s1", 1.0, None, "decode-1-19720"),  # its second turn never reached the lake
        ("run-b-s0", 2.0, None, "decode-1-19720"),  # another run's session of the same name
    ]
    fields = [SCHEMAS["requests"].field(n) for n in ("session_id", "t_arrival", "prefill_node", "decode_node")]
    table = pa.table(
        [
            pa.array([r[0] for r in rows], fields[0].type),
            pa.array([t + dt.timedelta(seconds=r[1]) for r in rows], fields[1].type),
            pa.array([r[2] for r in rows], fields[2].type),
            pa.array([r[3] for r in rows], fields[3].type),
        ],
        schema=pa.schema(fields),
    )
    part = tmp_path / "lake" / "requests" / "date=2026-12-04" / "hour=9"
    part.mkdir(parents=True)
    pq.write_table(table, part / "part-1.parquet")
    nodes = [_node("decode-1-19720", Role.DECODE), _node("prefill-0-19710", Role.PREFILL)]
    replay = [
        {"request_id": "s0-t1", "session_id": "s0", "sent_s": 5.0},
        {"request_id": "s0-t0", "session_id": "s0", "sent_s": 0.0},
        {"request_id": "s1-t0", "session_id": "s1", "sent_s": 1.0},
        {"request_id": "s1-t1", "session_id": "s1", "sent_s": 3.0},
    ]
    routes = real_routes(tmp_path / "lake", "run-a-", nodes, replay)
    assert routes == {"s0-t0": "prefill-1->decode-0", "s0-t1": "decode-0"}

    sim_rows = [
        {"request_id": "s0-t0", "route": "prefill-1->decode-0"},
        {"request_id": "s0-t1", "route": "prefill-1->decode-0"},  # the simulated router disaggregated it
        {"request_id": "s1-t0", "route": "decode-0"},
        {"request_id": "s1-t1", "route": "decode-0"},
    ]
    assert routes_agree(routes, sim_rows) == {"requests": 4, "matched": 2, "agree": 1, "share": 0.5}
