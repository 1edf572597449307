"""Router replicas share no index: each subscribes to every engine's KV events itself. Fed the same
event streams, two cache_aware replicas make the same decision for every request of an agent-like
sequence, including a replica that joins late and catches up through the engines' replay endpoints."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq.asyncio

from contracts.registry import Role
from router.kv_index.block_keys import BlockHasher
from router.kv_index.index import FleetIndex
from router.kv_index.subscriber import KVEventSubscriber
from router.policies import CacheAware, CacheAwareConfig, Decision, RoutingRequest
from tests.router.policies.helpers import cand
from tests.support.vllm_helpers import EnginePrefixCache
from tests.support.zmq_helpers import FakePublisher, until

BS = 16
NODES = ("p0", "p1")


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@dataclass
class Replica:
    fleet: FleetIndex
    policy: CacheAware
    subs: list[KVEventSubscriber]


def _tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(49_152) for _ in range(n)]


def _agent_prompts(seed: int = 3) -> list[list[int]]:
    """3 repositories x 2 sessions x 4 turns; each turn resends the session's history plus ~2 blocks;
    sessions interleave the way concurrent agents do."""
    rng = random.Random(seed)
    system = _tokens(3 * BS, rng)
    repos = [_tokens(5 * BS + 7, rng) for _ in range(3)]
    sessions = [system + repos[i % 3] + _tokens(BS // 2, rng) for i in range(6)]
    out = []
    for _turn in range(4):
        for i in rng.sample(range(6), 6):
            out.append(list(sessions[i]))
            sessions[i] += _tokens(2 * BS + rng.randrange(BS), rng)
    return out


async def test_two_replicas_decide_alike_on_the_same_sequence(
    tmp_path: Path, ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hasher = BlockHasher(BS, "sha256_cbor")
    endpoints = {n: (f"ipc://{tmp_path}/{n}-ev", f"ipc://{tmp_path}/{n}-rp") for n in NODES}
    engines = {n: EnginePrefixCache(BS, "sha256_cbor", num_blocks=1024) for n in NODES}
    cached: dict[str, dict[bytes, object]] = {n: {} for n in NODES}  # block hash -> block, per engine
    pubs = {n: FakePublisher(ctx, *endpoints[n]) for n in NODES}
    # Local prefill off: every request takes the prefill pool, the part that reads the index.
    config = CacheAwareConfig(local_prefill_max_tokens=0)

    async def replica() -> Replica:
        fleet = FleetIndex()
        subs = [KVEventSubscriber(fleet.model("m", BS), n, *endpoints[n], ctx=ctx, hasher=hasher) for n in NODES]
        for sub in subs:
            sub.start()
        for n, sub in zip(NODES, subs, strict=True):
            await pubs[n].connected(lambda s=sub: s.stats.live_batches > 0)
        return Replica(fleet, CacheAware(fleet, config), subs)

    def decide(r: Replica, rr: RoutingRequest, step: int) -> Decision:
        # Both replicas see the same heartbeats: p0 reports a waiting request on every other step.
        return r.policy.select(rr, [cand("p0", waiting=step % 2), cand("p1")], [cand("d0", Role.DECODE)])

    prompts = _agent_prompts()
    chosen: list[tuple[str, float]] = []
    a, b = await replica(), None
    try:
        for step, prompt in enumerate(prompts):
            if step == len(prompts) // 3:  # a replica that starts after a third of the traffic
                b = await replica()
                await until(lambda r=b: r.fleet.block_counts() == a.fleet.block_counts(), what="late replica caught up")
            keys = hasher.keys(prompt)
            rr = RoutingRequest(
                request_id=f"r{step}", model="m", prompt_token_ids=tuple(prompt), block_keys=tuple(keys)
            )
            da = decide(a, rr, step)
            if b is not None:
                db = decide(b, rr, step)
                assert (db.prefill.node_id, db.decode.node_id, db.reason, db.extra) == (
                    da.prefill.node_id,
                    da.decode.node_id,
                    da.reason,
                    da.extra,
                ), f"step {step}"
            # The chosen engine computes the prompt, caches its full blocks and publishes the events.
            node = da.prefill.node_id
            chosen.append((node, da.extra["routed_cached_tokens"]))
            hashes = hasher.block_hashes(prompt)
            prefix = []
            for h in hashes:
                if h not in cached[node]:
                    break
                prefix.append(cached[node][h])
            _, blocks = engines[node].store(prompt, prefix_blocks=prefix)
            cached[node].update(zip(hashes, blocks, strict=True))
            pubs[node].publish(engines[node].take_events())
            for r in (a, b):
                if r is not None:
                    await until(
                        lambda r=r, k=keys, n=node: r.fleet.longest_prefix("m", k).get(n) == len(k),
                        what=f"step {step} events",
                    )
                    r.policy.on_complete(da if r is a else db)
        assert b is not None and b.fleet.block_counts() == a.fleet.block_counts()
        # Not a trivial agreement: both nodes were used, and most requests found a cached prefix there.
        assert {n for n, _ in chosen} == set(NODES)
        assert sum(1 for _, hit in chosen if hit > 0) >= len(prompts) * 3 // 4
    finally:
        for r in (a, b):
            if r is not None:
                for sub in r.subs:
                    await sub.stop()
        for pub in pubs.values():
            await pub.close()
