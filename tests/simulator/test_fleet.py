"""SIMULATOR bookkeeping: the arithmetic progress (no per-token work) must still give each request
exactly its output tokens at increasing times, leave no block held, and survive pools small enough
that requests wait for blocks and get preempted; closed-loop arrivals follow the simulated answers as
the replay's follow the real ones; a prompt over the step's token budget goes in chunks."""

from __future__ import annotations

import numpy as np
import pytest

from contracts.registry import Role
from router.policies import CacheAware, CacheAwareConfig
from simulator.fleet import FleetSim, NodeSpec, SimRequest
from simulator.keys import prepare
from simulator.step_model import StepModel
from traces.hashing import chain_segments, regroup
from traces.schema import Trace, TraceMeta, add_row, empty_columns, make_trace
from traces.synth import AgenticSpec, synth_agentic

TRACE = synth_agentic(
    AgenticSpec(sessions=30, seed=3, session_rate=20.0, system_tokens=256, turns_mean=3.0, max_input_tokens=1500)
)


@pytest.mark.parametrize("num_blocks", [4000, 160], ids=["roomy", "tight"])
def test_every_request_gets_its_tokens_in_order_and_no_block_is_left_held(num_blocks):
    specs = [NodeSpec(Role.PREFILL, num_blocks=num_blocks), NodeSpec(Role.DECODE, num_blocks=num_blocks)]
    sim = FleetSim(
        specs, lambda lookup: CacheAware(lookup, CacheAwareConfig()), step=StepModel(decode_s_per_ctx_token=1e-7)
    )
    done = sim.run(TRACE)
    assert len(done) == len(TRACE)
    for r in done:
        times = sim.token_times(r)
        assert len(times) == r.output_tokens, r.request_id
        assert np.all(np.diff(times) > 0)
        assert times[0] == r.first_token_s and times[-1] == r.finish_s
        assert r.first_token_s > r.arrival_s
    for n in sim.nodes:
        assert n.pool.free_blocks == n.pool.num_blocks - 1 and not n.running and not n.grow_at and not n.finish_at
    if num_blocks == 160:  # the tight pool really did make requests wait for blocks
        assert sim.preemptions > 0 or any(r.stalls for r in done)


def test_prepared_keys_share_exactly_where_regroup_shares():
    prep = prepare(TRACE, 4)  # synth's 16-token base blocks split in four
    table = TRACE.table
    hashes, n_in = table.column("block_hashes").to_pylist(), table.column("input_tokens").to_pylist()
    slow = [regroup(h, n, TRACE.meta.block_tokens, 4) for h, n in zip(hashes, n_in, strict=True)]
    fast = [prep.keys_of(i) for i in range(len(prep))]
    assert [len(k) for k in fast] == [len(k) for k in slow]
    a = {(i, j): k for i, ks in enumerate(slow) for j, k in enumerate(ks)}
    b = {(i, j): k for i, ks in enumerate(fast) for j, k in enumerate(ks)}
    groups_a: dict[int, set] = {}
    groups_b: dict[int, set] = {}
    for pos in a:
        groups_a.setdefault(a[pos], set()).add(pos)
        groups_b.setdefault(b[pos], set()).add(pos)
    assert sorted(map(sorted, groups_a.values())) == sorted(map(sorted, groups_b.values()))


def _two_turns(gap_s: float | None, parent_arrival: float = 0.0, child_arrival: float = 0.5) -> Trace:
    cols = empty_columns()
    first = [("sys", 64), ("user", 32)]
    for rid, parent, arrival, segs, gap in (
        ("t0", None, parent_arrival, first, None),
        ("t1", "t0", child_arrival, [*first, ("answer", 8), ("tool", 40)], gap_s),
    ):
        add_row(
            cols,
            request_id=rid,
            session_id="s",
            parent_request_id=parent,
            turn=int(rid[1]),
            arrival_s=arrival,
            gap_s=gap,
            input_tokens=sum(n for _, n in segs),
            output_tokens=8,
            block_hashes=chain_segments(segs, 16),
        )
    return make_trace(cols, TraceMeta(16, "test", ""))


STEP = StepModel(base_s=0.05, prefill_s_per_token=0.001, decode_s_per_seq=0.0, request_overhead_s=0.02)


def _run(trace: Trace, closed: bool) -> dict[str, SimRequest]:
    sim = FleetSim([NodeSpec(Role.BOTH, num_blocks=64)], lambda lookup: CacheAware(lookup), step=STEP)
    return {r.request_id: r for r in sim.run(trace, closed_loop=closed)}


def test_closed_loop_sends_a_turn_its_gap_after_the_previous_answer_ends():
    done = _run(_two_turns(gap_s=0.3), closed=True)
    assert done["t1"].arrival_s == pytest.approx(done["t0"].finish_s + 0.3)
    # its first token: the overhead, then one step prefilling what the first turn did not cache
    cached = done["t1"].engine_cached_tokens
    assert cached == 96  # the first turn's six full blocks of 16
    assert done["t1"].first_token_s == pytest.approx(done["t1"].arrival_s + 0.02 + 0.05 + 0.001 * (144 - cached))
    # open loop the same trace sends it at its recorded arrival, while the first turn still runs
    opened = _run(_two_turns(gap_s=0.3, child_arrival=0.2), closed=False)
    assert opened["t1"].arrival_s == 0.2 < opened["t0"].finish_s


def test_closed_loop_without_a_gap_keeps_the_recorded_spacing_but_never_leaves_before_the_answer():
    spaced = _run(_two_turns(gap_s=None, child_arrival=5.0), closed=True)
    assert spaced["t1"].arrival_s == pytest.approx(5.0)  # t0 ended long before its recorded spacing
    early = _run(_two_turns(gap_s=None, child_arrival=0.01), closed=True)
    assert early["t1"].arrival_s == pytest.approx(early["t0"].finish_s)


def test_a_prompt_longer_than_the_token_budget_is_prefilled_in_chunks():
    cols = empty_columns()
    add_row(
        cols,
        request_id="long",
        session_id=None,
        parent_request_id=None,
        turn=0,
        arrival_s=0.0,
        input_tokens=1000,
        output_tokens=2,
        block_hashes=chain_segments([("long", 1000)], 16),
    )
    trace = make_trace(cols, TraceMeta(16, "test", ""))
    step = StepModel(base_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.0)
    sim = FleetSim(
        [NodeSpec(Role.BOTH, num_blocks=128, max_batched_tokens=400)], lambda lookup: CacheAware(lookup), step=step
    )
    (r,) = sim.run(trace)
    # 400 + 400 + 200 tokens in three steps: the first token comes at the end of the third
    assert r.first_token_s == pytest.approx(3 * 0.01 + 1000 * 0.001)
    assert len(sim.nodes[0].step_end) == 4 and not sim.nodes[0].prefilling


def test_a_step_that_prefills_beside_running_decodes_costs_what_the_step_model_says():
    # one request decodes for a while; a second arrives and is prefilled in a step beside it: that step
    # lasts the model's price of both together (the mixed points of a profile measure exactly that)
    trace = _unrelated((("decoding", 0.0, 64, 40), ("arriving", 0.5, 300, 2)))
    step = StepModel(
        base_s=0.02,
        prefill_s_per_token=1e-4,
        prefill_s_per_new_pair=2e-7,
        decode_s_per_seq=3e-3,
        decode_s_per_ctx_token=4e-5,
    )
    sim = FleetSim([NodeSpec(Role.BOTH, num_blocks=128)], lambda lookup: CacheAware(lookup), step=step)
    done = {r.request_id: r for r in sim.run(trace)}
    ends = sim.nodes[0].step_end
    k = ends.index(done["arriving"].first_token_s)
    decoding = done["decoding"]
    made_before = int(np.sum(sim.token_times(decoding) <= ends[k - 1]))
    assert 0 < made_before < decoding.output_tokens  # it really was decoding beside the prompt
    ctx = decoding.prompt_tokens + made_before
    assert ends[k] - ends[k - 1] == pytest.approx(step.step_s(300, 1, ctx, 0.0, 300 * 300 / 2))


def _unrelated(requests: tuple[tuple[str, float, int, int], ...]) -> Trace:
    """(request id, arrival, input tokens, output tokens) with nothing shared, no sessions."""
    cols = empty_columns()
    for rid, arrival, n_in, n_out in requests:
        add_row(
            cols,
            request_id=rid,
            session_id=None,
            parent_request_id=None,
            turn=0,
            arrival_s=arrival,
            input_tokens=n_in,
            output_tokens=n_out,
            block_hashes=chain_segments([(rid, n_in)], 16),
        )
    return make_trace(cols, TraceMeta(16, "test", ""))


def _two_alone(b_arrival: float) -> Trace:
    return _unrelated((("a", 0.0, 100, 1), ("b", b_arrival, 100, 1)))


@pytest.mark.parametrize("host", [None, "h"], ids=["own-machines", "one-host"])
def test_a_neighbour_mid_step_slows_a_step_from_the_moment_it_starts_and_no_longer(host):
    # a: one 0.15 s step from 0; b arrives at 0.05 on the other node (a's node has a request in flight).
    # On one host at half speed each while both compute: by 0.05 a has 0.10 s of work left, which takes
    # 0.20 s beside b (ends 0.25); b did 0.10 s of its 0.15 by then and finishes the rest alone (0.30).
    step = StepModel(base_s=0.05, prefill_s_per_token=0.001, decode_s_per_seq=0.0, shared_slowdown=2.0)
    sim = FleetSim([NodeSpec(Role.BOTH, host=host), NodeSpec(Role.BOTH, host=host)], CacheAware, step=step)
    done = {r.request_id: r for r in sim.run(_two_alone(0.05))}
    assert done["a"].decision.decode.node_id != done["b"].decision.decode.node_id
    if host is None:
        assert (done["a"].first_token_s, done["b"].first_token_s) == pytest.approx((0.15, 0.20))
    else:
        assert (done["a"].first_token_s, done["b"].first_token_s) == pytest.approx((0.25, 0.30))
    # a neighbour that is idle again costs nothing: b alone after both finished takes its 0.15 s
    again = FleetSim([NodeSpec(Role.BOTH, host=host)] * 2, CacheAware, step=step)
    later = {r.request_id: r for r in again.run(_two_alone(1.0))}
    assert later["b"].first_token_s == pytest.approx(1.15)
