"""SIMULATOR: a fleet of simulated nodes in simulated time, routed by the real router's policy objects.
Everything it prints or returns is a simulation and says so (``SIMULATED``).

The parts:

- Nodes (``SimNode``): a real registry record (``contracts.registry.NodeInfo``: role, block size,
  blocks) and a ``SimBlockPool`` (vLLM's block accounting, tested block for block against vLLM).
  Each node runs steps like vLLM's continuous batching: at a step's start every running request
  decodes one token (``grow``; a request that finds no free block waits a step), then waiting
  requests are admitted first come first served while their uncached prompt tokens fit
  ``max_batched_tokens`` (the first always does) and the pool has room (else they wait: vLLM keeps
  them waiting too). A step lasts ``StepModel.step_s`` of its prefill tokens and decode batch.
- Roles: a colocated node (``both``) or a decode node prefilling for itself runs a request whole.
  With a P/D decision the prefill node prefills (its blocks cached there), the KV moves
  (``StepModel.transfer_s``), the prefill node frees its blocks when the transfer ends (the lease),
  and the decode node admits the request with every prompt block arriving (no prefill compute;
  what it already held counts as its own hit) and decodes. The client's first token is the first
  token the decode side produces.
- The router: the real policy (``router.policies``, built by ``make_policy``) is given what the real
  router gives it. Candidates are ``router.policies.Candidate`` of ``LiveNode`` records whose
  ``NodeLoad`` (running, waiting, KV usage) is refreshed every ``heartbeat_s`` simulated seconds (the
  real router re-reads the registry each second), plus the router's own in-flight count per node
  (as ``router.fleet.Fleet.track``: on the prefill node during the prefill leg, on the decode node
  until the answer ends); the pool choice is ``Orchestrator._select``'s (P/D when both pools
  exist, else colocated, else decode: ``select_pools``, checked equal to the real one by a test);
  ``on_complete`` is called when the request ends. The prefix lookup (``SimLookup``) reads the
  nodes' pools directly: what the router's ``FleetIndex`` would hold with every KV event applied
  (a test feeds the real index the simulator's events and gets the same decisions).
- Keys: a trace's chained hashes regrouped to the nodes' block size (``traces.hashing.regroup``);
  decoded tokens' blocks get keys no prompt has.

Preemption: when no running request can get a block, the newest gives its blocks back and waits at
the head of the queue (as vLLM does; the recomputation it costs there is not charged here).

Not modelled yet: chunked prefill's interleaving inside a step, admission queues and
rate limits, request cancels, transfer contention, the step model's fit (``StepModel`` holds
PLACEHOLDER coefficients until ``tandem profile`` measures them).
"""

from __future__ import annotations

import heapq
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import xxhash

from contracts.registry import LiveNode, NodeInfo, NodeLoad, Role
from router.fleet import Pools
from router.policies import Candidate, Decision, RoutingPolicy, RoutingRequest
from simulator.block_pool import SimBlockPool
from traces.hashing import regroup
from traces.schema import Trace

SIMULATED = "SIMULATED"
"""The label on everything the simulator reports."""


@dataclass(frozen=True)
class StepModel:
    """Time of one engine step and of a KV transfer. PLACEHOLDER coefficients (roughly SmolLM2-135M on
    two shared CPU cores) until ``tandem profile`` fits them from measurements."""

    base_s: float = 0.004
    """Fixed cost of a step."""
    prefill_s_per_token: float = 0.0002
    """Per uncached prompt token computed in the step."""
    decode_s_per_seq: float = 0.001
    """Per running request decoding a token in the step."""
    kv_bytes_per_token: int = 23_040
    """KV bytes per token (SmolLM2-135M, bf16)."""
    transfer_base_s: float = 0.002
    """Fixed cost of a KV transfer."""
    transfer_bytes_per_s: float = 2e9
    """KV transfer bandwidth."""

    def step_s(self, prefill_tokens: int, decode_batch: int) -> float:
        return self.base_s + self.prefill_s_per_token * prefill_tokens + self.decode_s_per_seq * decode_batch

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_base_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s


@dataclass(frozen=True)
class NodeSpec:
    role: Role
    num_blocks: int = 4096
    """KV capacity in blocks."""
    block_size: int = 16
    max_batched_tokens: int = 8192
    """Prompt tokens a step may prefill (vLLM's ``max_num_batched_tokens``)."""


@dataclass
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
    token_times: list[float] = field(default_factory=list)
    generated: int = 0
    _out_keys: list[int] = field(default_factory=list)

    def all_keys(self, num_tokens: int, block_size: int) -> list[int]:
        """Prompt keys, then keys for the blocks decoded tokens fill (unique to this request)."""
        full = num_tokens // block_size
        while len(self.keys) + len(self._out_keys) < full:
            self._out_keys.append(xxhash.xxh64_intdigest(struct.pack("<qq", self.index, len(self._out_keys)) + b"out"))
        return self.keys + self._out_keys


@dataclass
class _Work:
    req: SimRequest
    phase: str
    """prefill: a P/D prefill leg; full: prefill and decode here; remote: decode with the KV moved in."""


@dataclass
class SimNode:
    info: NodeInfo
    spec: NodeSpec
    pool: SimBlockPool
    waiting: deque[_Work] = field(default_factory=deque)
    running: list[_Work] = field(default_factory=list)
    busy: bool = False
    load: NodeLoad = field(default_factory=NodeLoad)
    """What the router last read (refreshed every heartbeat)."""

    def live(self) -> LiveNode:
        return LiveNode(info=self.info, load=self.load)


class SimLookup:
    """The router's ``PrefixLookup`` over the simulated nodes' pools: leading blocks each holds."""

    def __init__(self, nodes: Sequence[SimNode]) -> None:
        self.nodes = nodes

    def longest_prefix(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            if n.info.model != model:
                continue
            m = n.pool.lookup(keys, (len(keys) + 1) * n.pool.block_size)  # uncapped: the policy caps
            if m:
                out[n.info.node_id] = m
        return out


def select_pools(policy: RoutingPolicy, rr: RoutingRequest, pools: Pools) -> Decision:
    """The pool choice of ``router.orchestrator.Orchestrator._select`` with no client preference."""
    if pools.prefill and pools.decode:
        return policy.select(rr, pools.prefill, pools.decode)
    if pools.colocated:
        return policy.select(rr, [], pools.colocated)
    if pools.decode:
        return policy.select(rr, [], pools.decode)
    raise ValueError("no decode or colocated node in the simulated fleet")


LogEntry = tuple[str, object]
"""("route", (RoutingRequest, Pools, Decision)) | ("done", Decision) | ("kv", (node_id, "stored"|"removed", key))."""


class FleetSim:
    """SIMULATED fleet. ``run(trace)`` returns the requests with their simulated times."""

    def __init__(
        self,
        specs: Sequence[NodeSpec],
        make_policy: Callable[[SimLookup], RoutingPolicy],
        *,
        step: StepModel | None = None,
        model: str = "sim",
        heartbeat_s: float = 1.0,
        record: bool = False,
    ) -> None:
        if not specs:
            raise ValueError("a fleet needs nodes")
        sizes = {s.block_size for s in specs}
        if len(sizes) != 1:
            raise ValueError(f"one block size per model (got {sorted(sizes)})")
        self.block_size = sizes.pop()
        self.model = model
        self.step = step or StepModel()
        self.heartbeat_s = heartbeat_s
        self.nodes = [
            SimNode(
                info=NodeInfo(
                    node_id=f"{s.role.value}-{i}",
                    role=s.role,
                    model=model,
                    url=f"sim://{s.role.value}-{i}",
                    block_size=s.block_size,
                    max_model_len=1 << 30,
                    kv_connector="sim" if s.role is not Role.BOTH else "none",
                    num_kv_blocks=s.num_blocks,
                ),
                spec=s,
                pool=SimBlockPool(s.num_blocks, s.block_size),
            )
            for i, s in enumerate(specs)
        ]
        self._by_id = {n.info.node_id: n for n in self.nodes}
        self.lookup = SimLookup(self.nodes)
        self.policy = make_policy(self.lookup)
        self.inflight: dict[str, int] = {}
        self.preemptions = 0
        self.record = record
        self.log: list[LogEntry] = []
        self._events: list[tuple[float, int, str, object]] = []
        self._current: dict[str, tuple[list[_Work], list[_Work]]] = {}
        """Per busy node: the step in progress (requests decoding, requests admitted)."""
        self._seq = 0
        self.now = 0.0

    # --- the event loop -------------------------------------------------------------------------
    def _at(self, t: float, kind: str, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def run(self, trace: Trace) -> list[SimRequest]:
        base = trace.meta.block_tokens
        t = trace.table
        reqs = [
            SimRequest(
                index=i,
                request_id=rid,
                session_id=sid,
                arrival_s=arr,
                prompt_tokens=n_in,
                output_tokens=max(1, n_out),
                keys=regroup(h, n_in, base, self.block_size),
            )
            for i, (rid, sid, arr, n_in, n_out, h) in enumerate(
                zip(
                    t.column("request_id").to_pylist(),
                    t.column("session_id").to_pylist(),
                    t.column("arrival_s").to_pylist(),
                    t.column("input_tokens").to_pylist(),
                    t.column("output_tokens").to_pylist(),
                    t.column("block_hashes").to_pylist(),
                    strict=True,
                )
            )
        ]
        smallest = min(n.pool.num_blocks - 1 for n in self.nodes)
        for r in reqs:
            if -(-(r.prompt_tokens + r.output_tokens) // self.block_size) > smallest:
                raise ValueError(
                    f"request {r.request_id} ({r.prompt_tokens} + {r.output_tokens} tokens) cannot fit a node's "
                    f"{smallest} blocks of {self.block_size}"
                )
            self._at(r.arrival_s, "arrive", r)
        self._heartbeat()
        pending = len(reqs)
        while self._events and pending:
            if len(self._events) == 1:  # only the heartbeat left: nothing can happen any more
                raise RuntimeError(f"simulation stalled at {self.now:.1f} s with {pending} requests unfinished")
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                assert isinstance(payload, SimRequest)
                self._route(payload)
            elif kind == "step":
                assert isinstance(payload, SimNode)
                pending -= self._end_step(payload)
            elif kind == "transfer":
                assert isinstance(payload, tuple)
                self._transferred(*payload)
            elif kind == "heartbeat":
                self._heartbeat()
        return reqs

    def _heartbeat(self) -> None:
        for n in self.nodes:
            n.load = NodeLoad(
                running=len(n.running), waiting=len(n.waiting), kv_usage=n.pool.usage, updated_at=self.now
            )
        self._at(self.now + self.heartbeat_s, "heartbeat", None)

    # --- routing --------------------------------------------------------------------------------
    def _candidates(self, role: Role) -> list[Candidate]:
        return [
            Candidate(node=n.live(), inflight=self.inflight.get(n.info.node_id, 0))
            for n in self.nodes
            if n.info.role is role
        ]

    def _track(self, node_id: str, delta: int) -> None:
        left = self.inflight.get(node_id, 0) + delta
        if left > 0:
            self.inflight[node_id] = left
        else:
            self.inflight.pop(node_id, None)

    def _route(self, r: SimRequest) -> None:
        pools = Pools(
            prefill=self._candidates(Role.PREFILL),
            decode=self._candidates(Role.DECODE),
            colocated=self._candidates(Role.BOTH),
        )
        rr = RoutingRequest(
            request_id=r.request_id,
            model=self.model,
            prompt_token_ids=(0,) * r.prompt_tokens,
            session_id=r.session_id,
            block_keys=tuple(r.keys),
        )
        d = r.decision = select_pools(self.policy, rr, pools)
        if self.record:
            self.log.append(("route", (rr, pools, d)))
        self._track(d.decode.node_id, +1)
        if d.prefill is not None:
            self._track(d.prefill.node_id, +1)
            self._enqueue(self._by_id[d.prefill.node_id], _Work(r, "prefill"))
        else:
            self._enqueue(self._by_id[d.decode.node_id], _Work(r, "full"))

    # --- nodes ----------------------------------------------------------------------------------
    def _enqueue(self, node: SimNode, work: _Work) -> None:
        node.waiting.append(work)
        if not node.busy:
            self._start_step(node)

    def _kv(self, node: SimNode) -> None:
        if self.record:
            for kind, key in node.pool.events:
                self.log.append(("kv", (node.info.node_id, kind, key)))
        node.pool.events.clear()

    def _start_step(self, node: SimNode) -> None:
        bs = node.pool.block_size
        decoding = []
        for w in node.running:
            n = w.req.prompt_tokens + w.req.generated  # the last token made needs its KV slot now
            if node.pool.grow(w.req.request_id, w.req.all_keys(n, bs), n):
                decoding.append(w)
        prefill_tokens = 0
        admitted: list[_Work] = []
        while node.waiting:
            w = node.waiting[0]
            r = w.req
            if admitted and prefill_tokens + r.prompt_tokens > node.spec.max_batched_tokens:
                break
            hit = node.pool.admit(r.request_id, r.keys, r.prompt_tokens)
            if hit is None:
                break
            node.waiting.popleft()
            if w.phase != "remote":
                r.engine_cached_tokens = hit
                prefill_tokens += r.prompt_tokens - hit
            admitted.append(w)
        self._kv(node)
        if not decoding and not admitted and node.running:
            # every running request is out of blocks: the newest gives its blocks back and waits at the
            # head of the queue (vLLM preempts the same way; its recomputation is not charged here)
            w = node.running.pop()
            node.pool.free(w.req.request_id)
            self._kv(node)
            node.waiting.appendleft(w)
            self.preemptions += 1
            self._start_step(node)
            return
        if not decoding and not admitted:
            node.busy = False
            return
        node.busy = True
        self._current[node.info.node_id] = (decoding, admitted)
        self._at(self.now + self.step.step_s(prefill_tokens, len(decoding)), "step", node)

    def _end_step(self, node: SimNode) -> int:
        decoding, admitted = self._current.pop(node.info.node_id)
        finished = 0
        for w in decoding:
            finished += self._token(node, w)
        for w in admitted:
            if w.phase == "prefill":
                d = w.req.decision
                assert d is not None and d.prefill is not None
                self._track(d.prefill.node_id, -1)
                self._at(self.now + self.step.transfer_s(w.req.prompt_tokens), "transfer", (node, w.req))
            else:
                node.running.append(w)
                finished += self._token(node, w)
        self._start_step(node)
        return finished

    def _token(self, node: SimNode, w: _Work) -> int:
        r = w.req
        r.generated += 1
        r.token_times.append(self.now)
        if r.first_token_s is None:
            r.first_token_s = self.now
        if r.generated < r.output_tokens:
            return 0
        r.finish_s = self.now
        node.running.remove(w)
        node.pool.free(r.request_id)
        d = r.decision
        assert d is not None
        self._track(d.decode.node_id, -1)
        self.policy.on_complete(d)
        if self.record:
            self.log.append(("done", d))
        return 1

    def _transferred(self, prefill: SimNode, r: SimRequest) -> None:
        prefill.pool.free(r.request_id)  # the lease ends: P's blocks stay cached, evictable
        self._kv(prefill)
        if not prefill.busy and prefill.waiting:  # it may have been waiting for these blocks
            self._start_step(prefill)
        d = r.decision
        assert d is not None
        self._enqueue(self._by_id[d.decode.node_id], _Work(r, "remote"))
