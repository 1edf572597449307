"""SIMULATOR routing against the real router: the simulator's decisions, taken by the real policy on
the simulator's own prefix lookup (its nodes' block pools), must equal those of the real router's
pieces given the same inputs: a fresh real ``CacheAware`` over a real ``FleetIndex`` that receives
the simulator's KV events as ``BlockStored`` / ``BlockRemoved``, chosen through the real
``Orchestrator._select``, with ``on_complete`` at the same points. Any difference in the lookup, in
the events, in the pool choice or in the policy's state fails the test."""

from __future__ import annotations

import pytest

from contracts.registry import Role
from router.kv_index import FleetIndex
from router.kv_index.events import BlockRemoved, BlockStored
from router.planning.orchestrator import Orchestrator
from router.policies import CacheAware, CacheAwareConfig, Decision, LeastLoaded
from router.settings import RouterSettings
from simulator.fleet import FleetSim, NodeSpec, select_pools
from traces.synth import AgenticSpec, synth_agentic

TRACE = synth_agentic(
    AgenticSpec(
        sessions=40,
        seed=5,
        session_rate=4.0,
        system_tokens=512,
        repo_tokens=(256, 1024),
        turns_mean=4.0,
        gap_s_median=0.5,
        max_input_tokens=6000,
    )
)
CONFIG = CacheAwareConfig(imbalance_threshold=4, local_prefill_max_tokens=256)


def _real_router(index: FleetIndex) -> Orchestrator:
    """The real router's routing part; nothing else of it is called."""
    policy = CacheAware(index, CONFIG)
    return Orchestrator(RouterSettings(), fleet=None, client=None, policy=policy, tokenizer=None, metrics=None)  # type: ignore[arg-type]


def _replay_through_real_router(sim: FleetSim) -> list[tuple[Decision, Decision]]:
    index = FleetIndex()
    model = index.model(sim.model, sim.block_size)
    orch = _real_router(index)
    real_of: dict[int, Decision] = {}
    pairs = []
    for kind, item in sim.log:
        if kind == "kv":
            node_id, what, key = item
            cls = BlockStored if what == "stored" else BlockRemoved
            extra = {"block_size": sim.block_size} if cls is BlockStored else {}
            model.apply(node_id, cls(block_hashes=[key], medium="GPU", **extra))
        elif kind == "route":
            rr, pools, decision = item
            real = orch._select(rr, pools, None)
            real_of[id(decision)] = real
            pairs.append((decision, real))
        elif kind == "prefilled":
            orch.policy.on_prefilled(real_of[id(item)])
        else:
            orch.policy.on_complete(real_of[id(item)])
    return pairs


def _key(d: Decision) -> tuple:
    return (d.decode.node_id, d.prefill.node_id if d.prefill else None, d.reason, d.extra)


@pytest.mark.parametrize(
    "specs",
    [
        [NodeSpec(Role.PREFILL, num_blocks=600), NodeSpec(Role.PREFILL, num_blocks=600)]
        + [NodeSpec(Role.DECODE, num_blocks=600), NodeSpec(Role.DECODE, num_blocks=600)],
        [NodeSpec(Role.BOTH, num_blocks=500) for _ in range(3)],
        [NodeSpec(Role.BOTH, num_blocks=400) for _ in range(3)],
    ],
    ids=["2P2D", "3colocated", "3colocated-tight"],
)
def test_simulated_decisions_equal_the_real_routers_on_the_same_inputs(specs):
    sim = FleetSim(specs, lambda lookup: CacheAware(lookup, CONFIG), record=True)
    done = sim.run(TRACE)
    assert all(r.finish_s is not None for r in done) and len(done) == len(TRACE)
    pairs = _replay_through_real_router(sim)
    assert len(pairs) == len(TRACE)
    for i, (simulated, real) in enumerate(pairs):
        assert _key(simulated) == _key(real), f"decision {i}"
    # the run exercised what matters: cache hits, evictions, spread over nodes
    decisions = [d for d, _ in pairs]
    assert sum(d.extra["routed_cached_tokens"] > 0 for d in decisions) > len(decisions) // 2
    assert any(kind == "kv" and item[1] == "removed" for kind, item in sim.log)
    assert len({d.decode.node_id for d in decisions}) > 1
    if specs[0].num_blocks == 400:  # requests waited for blocks and were preempted on the way
        assert sim.preemptions > 0 and any(r.stalls for r in done)
    if specs[0].role is Role.PREFILL:
        assert any(d.prefill is not None for d in decisions) and any(d.prefill is None for d in decisions)


def test_a_changed_lookup_is_caught():
    """The comparison can fail: a simulator whose lookup forgets one node's blocks decides differently."""
    specs = [NodeSpec(Role.BOTH, num_blocks=500) for _ in range(3)]
    sim = FleetSim(specs, lambda lookup: CacheAware(lookup, CONFIG), record=True)
    real_lookup = sim.lookup.longest_prefix
    sim.lookup.longest_prefix = lambda model, keys: {  # type: ignore[method-assign]
        k: v for k, v in real_lookup(model, keys).items() if k != "both-0"
    }
    sim.run(TRACE)
    pairs = _replay_through_real_router(sim)
    assert any(_key(s) != _key(r) for s, r in pairs)


def test_pool_choice_equals_the_orchestrators():
    specs = [NodeSpec(Role.PREFILL), NodeSpec(Role.DECODE), NodeSpec(Role.BOTH)]
    sim = FleetSim(specs, lambda lookup: LeastLoaded(), record=True)
    sim.run(synth_agentic(AgenticSpec(sessions=3, seed=1, max_input_tokens=8000)))
    orch = Orchestrator(RouterSettings(), fleet=None, client=None, policy=LeastLoaded(), tokenizer=None, metrics=None)  # type: ignore[arg-type]
    routes = [item for kind, item in sim.log if kind == "route"]
    assert len(routes) >= 3
    for rr, pools, _ in routes:
        for p in (pools, type(pools)([], pools.decode, pools.colocated), type(pools)([], [], pools.colocated)):
            assert _key(select_pools(LeastLoaded(), rr, p))[:2] == _key(orch._select(rr, p, None))[:2]
