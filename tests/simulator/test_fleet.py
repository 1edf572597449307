"""SIMULATOR bookkeeping: the arithmetic progress (no per-token work) must still give each request
exactly its output tokens at increasing times, leave no block held, and survive pools small enough
that requests wait for blocks and get preempted."""

from __future__ import annotations

import numpy as np
import pytest

from contracts.registry import Role
from router.policies import CacheAware, CacheAwareConfig
from simulator.fleet import FleetSim, NodeSpec
from simulator.keys import prepare
from simulator.step_model import StepModel
from traces.hashing import regroup
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
