"""SIMULATOR: the simulated fleet's parts: a node's spec and state, a request, a request's work on a
node, and the prefix lookup the router's policy reads (see ``simulator.fleet`` for how they run).

- Nodes (``SimNode``): a real registry record (``contracts.registry.NodeInfo``: role, block size,
  blocks) and a ``SimBlockPool`` (vLLM's block accounting, tested block for block against vLLM),
  with the step-level state ``FleetSim`` keeps per node (waiting and running work, the steps at which
  running work needs a block or finishes, the host's neighbours and the running step's speed).
- Work (``Work``): one request's leg on one node (a P/D prefill leg, a whole request, or a decode
  leg with its KV moved in), its progress kept as arithmetic on the node's step counter.
- Keys: a trace's chained hashes regrouped to the nodes' block size (``simulator.keys``);
  decoded tokens' blocks get keys no prompt has.
- The lookup (``SimLookup``): the router's ``PrefixLookup`` over a fleet-wide map of which node holds
  which key, kept by the pools as they store and evict.

Shared hosts: nodes with the same ``NodeSpec.host`` share a machine (two engines on two cores here:
each pinned to a core, but one memory bus and one last-level cache). While another node of its host is
mid-step, a step progresses ``StepModel.shared_slowdown`` times slower, processor sharing: a node that
starts or stops computing changes the speed of its neighbours' running steps from that moment on,
their end events move (the old ones go stale, ``SimNode.end_seq``). Nodes without a host (the
planner's fleets) have no neighbours and pay nothing for this.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from contracts.registry import LiveNode, NodeInfo, NodeLoad, Role
from router.policies import Decision
from simulator.block_pool import SimBlockPool
from simulator.step_model import Profile, StepModel

__all__ = ["NodeSpec", "SimLookup", "SimNode", "SimRequest", "Work", "build_nodes"]


@dataclass(frozen=True)
class NodeSpec:
    role: Role
    num_blocks: int = 4096
    """KV capacity in blocks."""
    block_size: int = 16
    max_batched_tokens: int = 8192
    """Prompt tokens a step may prefill (vLLM's ``max_num_batched_tokens``)."""
    host: str | None = None
    """Nodes with the same host share a machine's memory bus and caches: a step runs
    ``StepModel.shared_slowdown`` times slower while another of them is mid-step. None: a machine
    of its own."""


@dataclass(eq=False)
class SimRequest:
    index: int
    request_id: str
    session_id: str | None
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    keys: list[int]
    """Keys of the prompt's full blocks at the fleet's block size."""
    decision: Decision | None = None
    engine_cached_tokens: int = 0
    """What the node that prefilled reused (vLLM's ``num_cached_tokens``)."""
    first_token_s: float | None = None
    finish_s: float | None = None
    generated: int = 0
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    """(node number, first step, last step): the steps whose ends made this request's tokens."""
    stalls: list[tuple[int, int]] = field(default_factory=list)
    """(node number, step): steps inside a span in which it waited for a block (no token)."""
    _all_keys: list[int] | None = None

    def all_keys(self, num_tokens: int, block_size: int) -> list[int]:
        """Prompt keys, then keys for the blocks decoded tokens fill (unique to this request)."""
        full = num_tokens // block_size
        if self._all_keys is None:
            self._all_keys = list(self.keys)
        out = self._all_keys
        while len(out) < full:
            j = len(out) - len(self.keys)
            out.append(xxhash.xxh64_intdigest(struct.pack("<qq", self.index, j) + b"out"))
        return out


@dataclass(eq=False)
class Work:
    req: SimRequest
    phase: str
    """prefill: a P/D prefill leg; full: prefill and decode here; remote: decode with the KV moved in."""
    seq: int = 0
    """Admission order on its node (vLLM serves running requests in that order)."""
    base: int = 0
    """While running: at the start of step s the request has generated ``s - base`` tokens."""
    grow_step: int = -1
    finish_step: int = -1
    first_step: int = 0
    todo: int = 0
    """Prompt tokens still to compute (uncached, or the last one of a remote prompt)."""
    chunk: int = 0
    """Prompt tokens the running step computes of it."""


@dataclass(eq=False)
class SimNode:
    number: int
    info: NodeInfo
    spec: NodeSpec
    pool: SimBlockPool
    step: StepModel
    waiting: deque[Work] = field(default_factory=deque)
    running: dict[int, Work] = field(default_factory=dict)
    """By admission order (``Work.seq``)."""
    busy: bool = False
    load: NodeLoad = field(default_factory=NodeLoad)
    """What the router last read (refreshed every heartbeat)."""
    steps: int = 0
    """Steps started so far: the current (or next) step's number."""
    step_end: list[float] = field(default_factory=list)
    grow_at: dict[int, list[Work]] = field(default_factory=dict)
    finish_at: dict[int, list[Work]] = field(default_factory=dict)
    ctx_const: int = 0
    """Sum over running requests of ``prompt - base``: their context at step s is this + s * running."""
    decoding: int = 0
    prefilling: list[Work] = field(default_factory=list)
    """Admitted (blocks held) with prompt tokens left to compute, in admission order."""
    admitted: list[Work] = field(default_factory=list)
    """The requests the running step prefills a chunk of."""
    live: LiveNode | None = None
    slot: int = 0
    """Index in its role's candidate list."""
    neighbours: list[SimNode] = field(default_factory=list)
    """The other nodes of its host (``NodeSpec.host``)."""
    work_left: float = 0.0
    """The running step's time still to go, in seconds of a step alone on its host, as of ``mark``."""
    mark: float = 0.0
    speed: float = 1.0
    """Share of a lone node's speed the running step progresses at (1 / its slowdown)."""
    end_seq: int = 0
    """The sequence number of the running step's end event (an earlier one is stale: its end moved)."""

    def __post_init__(self) -> None:
        self.live = LiveNode(info=self.info, load=self.load)


class SimLookup:
    """The router's ``PrefixLookup`` over the simulated fleet: leading blocks each node holds, read from
    the map key -> nodes holding it that the nodes' pools keep."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.index: dict[object, set[str]] = {}

    def longest_prefix(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        if model != self.model or not keys:
            return {}
        index = self.index
        alive = index.get(keys[0])
        if not alive:
            return {}
        alive = set(alive)
        out: dict[str, int] = {}
        for i in range(1, len(keys)):
            holders = index.get(keys[i])
            if holders is None:
                for n in alive:
                    out[n] = i
                return out
            if not alive <= holders:
                for n in alive - holders:
                    out[n] = i
                alive &= holders
                if not alive:
                    return out
        for n in alive:
            out[n] = len(keys)
        return out


def build_nodes(
    specs: Sequence[NodeSpec], profile: Profile, model: str, lookup: SimLookup, record: bool
) -> list[SimNode]:
    """A node per spec (``{role}-{i}``, as the registry would list them), its pool publishing into
    ``lookup``'s map, its step model the profile's for its role, and its host's other nodes as
    neighbours."""
    nodes = []
    for i, s in enumerate(specs):
        node_id = f"{s.role.value}-{i}"
        info = NodeInfo(
            node_id=node_id,
            role=s.role,
            model=model,
            url=f"sim://{node_id}",
            block_size=s.block_size,
            max_model_len=1 << 30,
            kv_connector="sim" if s.role is not Role.BOTH else "none",
            num_kv_blocks=s.num_blocks,
        )
        pool = SimBlockPool(
            s.num_blocks, s.block_size, events=record, index=lookup.index, owner=node_id, publish_on_compute=True
        )
        nodes.append(SimNode(number=i, info=info, spec=s, pool=pool, step=profile.for_role(s.role)))
    hosts: dict[str, list[SimNode]] = {}
    for n in nodes:
        if n.spec.host is not None:
            hosts.setdefault(n.spec.host, []).append(n)
    for members in hosts.values():
        for n in members:
            n.neighbours = [m for m in members if m is not n]
    return nodes
