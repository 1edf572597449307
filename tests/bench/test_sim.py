"""The sim-against-real comparison of ``tandem bench sim``: errors per metric, the ranking check and the
RESULT line (the worse configuration per metric)."""

from __future__ import annotations

from dataclasses import asdict

from bench.sim import errors, plan_matches_real, result_line
from contracts.registry import Role
from router.policies import CacheAware
from simulator.fleet import FleetSim, NodeSpec
from simulator.report import summarize
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
