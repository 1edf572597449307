"""The planner: targets parse as written, and the configuration it names is the cheapest of those its
simulations found meeting the targets (and it does meet them); an unreachable target names none."""

from __future__ import annotations

import pytest

from planner.search import SLO, plan
from simulator.keys import prepare
from simulator.step_model import placeholder_profile
from traces.synth import AgenticSpec, synth_agentic

TRACE = synth_agentic(
    AgenticSpec(sessions=120, seed=2, session_rate=30.0, system_tokens=256, turns_mean=3.0, max_input_tokens=3000)
)


def test_slo_parses_units_and_rejects_nonsense():
    assert SLO.parse("ttft_p90=1.5s,itl_p50=40ms").targets == {("ttft", 90.0): 1.5, ("itl", 50.0): 0.04}
    for bad in ("", "ttft=1s", "speed_p90=1s", "ttft_p90="):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_the_named_configuration_is_the_cheapest_that_met_the_targets():
    slo = SLO.parse("ttft_p90=0.5s,itl_p90=0.05s")
    result = plan(prepare(TRACE, 16), placeholder_profile(), slo, kv_tokens_per_node=64_000, max_nodes=40)
    assert result.best is not None and result.best.meets
    assert result.best.percentiles["ttft_p90"] <= 0.5 and result.best.percentiles["itl_p90"] <= 0.05
    meeting = [t for t in result.tried if t.meets]
    assert result.best.cost == min(t.cost for t in meeting)
    assert any(not t.meets for t in result.tried)  # the search did find the boundary
    assert {t.layout.colocated > 0 for t in result.tried} == {True, False}  # both layouts were tried


def test_an_unreachable_target_names_nothing():
    result = plan(
        prepare(TRACE, 16), placeholder_profile(), SLO.parse("ttft_p50=1ms"), kv_tokens_per_node=64_000, max_nodes=8
    )
    assert result.best is None


def test_once_a_layout_meets_the_targets_no_dearer_fleet_is_simulated():
    slo = SLO.parse("ttft_p90=0.5s,itl_p90=0.05s")
    result = plan(prepare(TRACE, 16), placeholder_profile(), slo, kv_tokens_per_node=64_000, max_nodes=40)
    best_so_far = float("inf")
    searched = [t for t in result.tried if t.layout.local_prefill_max_tokens == 256]  # not the threshold step
    for t in searched:
        if best_so_far < float("inf") and t.layout.colocated == 0:
            assert t.cost < best_so_far, t.layout.describe()
        if t.meets:
            best_so_far = min(best_so_far, t.cost)
    # and the answer is still the cheapest meeting layout of an unbounded search
    unbounded = [t for t in result.tried if t.meets]
    assert result.best is not None and result.best.cost == min(t.cost for t in unbounded)
