"""SIMULATOR: a fleet of simulated nodes in simulated time, routed by the real router's policy objects.
Everything it prints or returns is a simulation and says so (``SIMULATED``).

The parts:

- Nodes (``SimNode``): a real registry record (``contracts.registry.NodeInfo``: role, block size,
  blocks) and a ``SimBlockPool`` (vLLM's block accounting, tested block for block against vLLM).
  Each node runs steps like vLLM's (v1) scheduler with chunked prefill: a step has a budget of
  ``max_batched_tokens``; every running request that decodes takes one token of it (a request that
  needs a new block and finds none free waits a step), requests admitted earlier whose prompt is not
  yet computed take the next chunk of it, then waiting requests are admitted first come first served
  while budget is left and the pool has room (else they wait: vLLM keeps them waiting too), each
  taking as much of its uncached prompt as the budget leaves. A request's prompt is done at the end of
  the step that computed its last chunk, which makes its first token. A step lasts
  ``StepModel.step_s`` of its prefill tokens, decode batch, the decode batch's context tokens and,
  when it decodes, the node's distinct KV tokens held (blocks in use times block size).
  An admitted request holds (and caches) its whole prompt's blocks from its first chunk on; vLLM
  allocates and caches them chunk by chunk, which differs only for a same-prefix request arriving in
  the middle of a long prompt's chunks, or in a pool too tight for both.
- Roles: a colocated node (``both``) or a decode node prefilling for itself runs a request whole.
  With a P/D decision the prefill node prefills (its blocks cached there), the KV moves
  (``StepModel.transfer_s``), the prefill node frees its blocks when the transfer ends (the lease),
  and the decode node admits the request with every prompt block arriving (it computes only the
  prompt's last token, as vLLM does with remote KV; what it already held counts as its own hit) and
  decodes. With a measured profile the transfer is the whole handover: the prefill leg's answer
  back to the router, the decode leg opened, the pull. The client's first token is the first
  token the decode side produces.
- The router (``simulator.sim_router.SimRouter``): the real policy objects, given what the real router
  gives them; the prefix lookup (``SimLookup``) as the router's ``FleetIndex`` would hold it.

Speed (what keeps a Mooncake-sized trace on hundreds of nodes within seconds): no Python work per
token. A running request's progress is arithmetic on its node's step counter (``Work.base``: at the
start of step s it holds ``prompt + s - base`` tokens); a node keeps, per future step, the requests
that will need a new block then (every ``block_size`` steps) and those that will finish then, so a
step touches only those. One heap event per step per node; arrivals are merged in from the sorted
trace rather than pushed up front. Each token's time is the end of a step of its node, so the node
records its step end times and a request's token times are read back afterwards
(``FleetSim.token_times``), less the steps it waited for a block.

Shared hosts: nodes of one ``NodeSpec.host`` slow each other's steps (``simulator.sim_nodes`` says how).

Preemption: when no running request can get a block, the newest gives its blocks back and waits at
the head of the queue (as vLLM does; the recomputation it costs there is not charged here).

Closed loop (``run(..., closed_loop=True)``, as ``tandem replay --mode closed`` sends): a session's
next turn arrives its recorded gap after the previous turn's last token, so the simulated load
follows the simulated answers as the replay's follows the real ones. Each request pays its first
node's ``request_overhead_s`` (HTTP, the router) before that node queues it.

Not modelled yet: admission queues and rate limits, request cancels, transfer contention; a
layer-wise pair's decode leg holding its blocks on the decode node from the prefill's start (here
from the handover on: the time it adds is measured, the blocks it holds meanwhile are not); a job
outside the fleet slowing the engines (``tandem bench sim`` records that load beside its figures).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np

from contracts.registry import LiveNode, NodeLoad, Role
from router.policies import RoutingPolicy
from simulator.keys import PreparedTrace, prepare
from simulator.sim_nodes import NodeSpec, SimLookup, SimNode, SimRequest, Work, build_nodes
from simulator.sim_router import LogEntry, SimRouter, select_pools
from simulator.step_model import Profile, StepModel
from traces.schema import Trace

SIMULATED = "SIMULATED"  # the label on everything the simulator reports

__all__ = ["SIMULATED", "FleetSim", "NodeSpec", "SimLookup", "SimRequest", "StepModel", "select_pools"]


_STEP, _TRANSFER, _HEARTBEAT, _QUEUE = 0, 1, 2, 3


class FleetSim:
    """SIMULATED fleet. ``run(trace)`` returns the requests with their simulated times.

    ``step``: one step model for every node, or a ``Profile`` (a model per node kind)."""

    def __init__(
        self,
        specs: Sequence[NodeSpec],
        make_policy: Callable[[SimLookup], RoutingPolicy],
        *,
        step: StepModel | Profile | None = None,
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
        profile = step if isinstance(step, Profile) else Profile(models={Role.BOTH: step or StepModel()})
        self.heartbeat_s = heartbeat_s
        self.lookup = SimLookup(model)
        self.nodes = build_nodes(specs, profile, model, self.lookup, record)
        self._by_id = {n.info.node_id: n for n in self.nodes}
        self.preemptions = 0
        self.record = record
        self.log: list[LogEntry] = []
        self.router = SimRouter(self.nodes, make_policy(self.lookup), model, self.log if record else None)
        self.policy = self.router.policy
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.now = 0.0
        self._pending = 0
        self._prep: PreparedTrace | None = None
        self._children: dict[int, list[int]] = {}
        """Closed loop: request index -> the turns that wait for its end."""
        self._later: list[tuple[float, int]] = []
        """Closed loop: (arrival time, index) of turns whose parent has finished."""
        self._sent: dict[int, float] = {}
        """Simulated arrival time of each request so far."""

    # --- the event loop -------------------------------------------------------------------------
    def _at(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def run(self, trace: Trace | PreparedTrace, *, closed_loop: bool = False) -> list[SimRequest]:
        """Simulate ``trace``; the requests in the order they arrived.

        ``closed_loop``: as ``tandem replay --mode closed`` sends it. A request whose parent (its
        session's previous turn) is in the trace arrives when the parent's last token is made plus the
        recorded ``gap_s``, or, with no gap recorded, at the recorded spacing after the parent's
        arrival but never before its last token; the others arrive at ``arrival_s``. Open loop
        (default): every request at ``arrival_s``."""
        prep = trace if isinstance(trace, PreparedTrace) else prepare(trace, self.block_size)
        if prep.block_size != self.block_size:
            raise ValueError(f"trace prepared for block size {prep.block_size}, fleet uses {self.block_size}")
        n_req = len(prep)
        self._check_fits(prep)
        self._prep, self._sent = prep, {}
        trace_arrival = prep.arrival_s.tolist()
        clocked = self._clocked(prep, closed_loop)
        self._later = []
        n_in, n_out = prep.input_tokens.tolist(), prep.output_tokens.tolist()
        reqs: list[SimRequest] = []
        self._heartbeat()
        self._pending = n_req
        events, later = self._events, self._later
        nxt, n_clocked = 0, len(clocked)
        while self._pending:
            at_clock = trace_arrival[clocked[nxt]] if nxt < n_clocked else float("inf")
            at_later = later[0][0] if later else float("inf")
            at = min(at_clock, at_later)
            if at <= events[0][0]:
                # the next arrival comes before (or with) the next event: arrivals first on ties
                if at_clock <= at_later:
                    i = clocked[nxt]
                    nxt += 1
                else:
                    _, i = heapq.heappop(later)
                self.now = max(self.now, at)
                self._sent[i] = self.now
                r = SimRequest(i, prep.request_id[i], prep.session_id[i], self.now, n_in[i], n_out[i], prep.keys_of(i))
                reqs.append(r)
                self._route(r)
                continue
            if at == float("inf") and len(events) == 1:  # only the heartbeat left: nothing can happen any more
                raise RuntimeError(f"simulation stalled at {self.now:.1f} s with {self._pending} requests unfinished")
            t, seq, kind, payload = heapq.heappop(events)
            if kind == _STEP and seq != payload.end_seq:  # type: ignore[attr-defined]
                continue  # a step whose end moved when a neighbour started or stopped
            self.now = t
            if kind == _STEP:
                self._end_step(payload)  # type: ignore[arg-type]
            elif kind == _TRANSFER:
                self._transferred(*payload)  # type: ignore[misc]
            elif kind == _QUEUE:
                self._enqueue(*payload)  # type: ignore[misc]
            else:
                self._heartbeat()
        events.clear()
        return reqs

    def _check_fits(self, prep: PreparedTrace) -> None:
        """Refuse a trace with a request no node could ever hold (it would wait forever)."""
        smallest = min(n.pool.num_blocks - 1 for n in self.nodes)
        need = -(-(prep.input_tokens + prep.output_tokens) // self.block_size)
        if len(prep) and int(need.max()) > smallest:
            i = int(need.argmax())
            raise ValueError(
                f"request {prep.request_id[i]} ({prep.input_tokens[i]} + {prep.output_tokens[i]} tokens) cannot fit "
                f"a node's {smallest} blocks of {self.block_size}"
            )

    def _clocked(self, prep: PreparedTrace, closed_loop: bool) -> list[int]:
        """The requests that arrive by the clock (all of them open loop), in arrival order; closed loop,
        the others wait in ``_children`` for their parent's end (then ``_later``)."""
        self._children = {}
        if not closed_loop:
            return list(range(len(prep)))
        clocked = []
        for i, parent in enumerate(prep.parent.tolist()):
            if parent >= 0:
                self._children.setdefault(parent, []).append(i)
            else:
                clocked.append(i)
        return clocked

    def _next_turns(self, r: SimRequest) -> None:
        """Closed loop: the turns waiting on ``r`` (just finished) get their arrival times."""
        prep = self._prep
        assert prep is not None  # set by run, which is what finishes requests
        for c in self._children.pop(r.index, ()):
            gap = float(prep.gap_s[c])
            if gap == gap:  # recorded (not NaN)
                at = self.now + gap
            else:
                at = max(self.now, self._sent[r.index] + float(prep.arrival_s[c] - prep.arrival_s[r.index]))
            heapq.heappush(self._later, (at, c))

    def _heartbeat(self) -> None:
        for n in self.nodes:
            n.load = NodeLoad(
                running=len(n.running), waiting=len(n.waiting), kv_usage=n.pool.usage, updated_at=self.now
            )
            n.live = LiveNode(info=n.info, load=n.load)
            self.router.refresh(n)
        self._at(self.now + self.heartbeat_s, _HEARTBEAT, None)

    # --- routing --------------------------------------------------------------------------------
    def _track(self, node_id: str, delta: int) -> None:
        self.router.track(self._by_id[node_id], delta)

    def _route(self, r: SimRequest) -> None:
        d = r.decision = self.router.route(r)
        self._track(d.decode.node_id, +1)
        if d.prefill is not None:
            self._track(d.prefill.node_id, +1)
            node, work = self._by_id[d.prefill.node_id], Work(r, "prefill")
        else:
            node, work = self._by_id[d.decode.node_id], Work(r, "full")
        # routed at arrival (the router decides before it forwards); queued once the request got there
        overhead = node.step.request_overhead_s
        if overhead > 0:
            self._at(self.now + overhead, _QUEUE, (node, work))
        else:
            self._enqueue(node, work)

    # --- nodes ----------------------------------------------------------------------------------
    def _enqueue(self, node: SimNode, work: Work) -> None:
        node.waiting.append(work)
        if not node.busy:
            self._start_step(node)

    def _kv(self, node: SimNode) -> None:
        if self.record:
            for kind, key in node.pool.events:
                self.log.append(("kv", (node.info.node_id, kind, key)))
            node.pool.events.clear()

    def _schedule_grow(self, node: SimNode, w: Work, held_tokens: int, not_before: int) -> None:
        """The step at whose start ``w`` first holds more tokens than its blocks (``held_tokens``'s) do."""
        bs = node.pool.block_size
        capacity = -(-held_tokens // bs) * bs
        s = max(w.base + capacity + 1 - w.req.prompt_tokens, not_before)
        w.grow_step = s
        if s <= w.finish_step:
            node.grow_at.setdefault(s, []).append(w)

    def _unschedule(self, node: SimNode, w: Work) -> None:
        for table, s in ((node.grow_at, w.grow_step), (node.finish_at, w.finish_step)):
            lst = table.get(s)
            if lst is not None and w in lst:
                lst.remove(w)
                if not lst:
                    del table[s]

    def _start_step(self, node: SimNode) -> None:
        s = node.steps
        pool = node.pool
        due = node.grow_at.pop(s, None)
        while True:
            stalled: list[Work] = []
            if due:
                due.sort(key=lambda w: w.seq)
                for w in due:
                    n = w.req.prompt_tokens + s - w.base  # the last token made needs its KV slot now
                    if pool.grow(w.req.request_id, w.req.all_keys(n, pool.block_size), n):
                        self._schedule_grow(node, w, n, s + 1)
                    else:
                        stalled.append(w)
            # vLLM's token budget: running requests first (one token each while decoding, the rest of
            # their prompt while prefilling), then waiting ones in arrival order while budget is left; a
            # prompt longer than what is left is prefilled in chunks over several steps
            budget = node.spec.max_batched_tokens - (len(node.running) - len(stalled))
            prefill_tokens = 0
            chunked: list[Work] = []
            ctx_pairs = new_pairs = 0.0
            for w in node.prefilling:
                if budget <= 0:
                    break
                w.chunk = min(w.todo, budget)
                budget -= w.chunk
                prefill_tokens += w.chunk
                ctx_pairs += w.chunk * (w.req.prompt_tokens - w.todo)
                new_pairs += w.chunk * w.chunk / 2
                chunked.append(w)
            while node.waiting and budget > 0:
                w = node.waiting[0]
                r = w.req
                hit = pool.admit(r.request_id, r.keys, r.prompt_tokens)
                if hit is None:
                    break
                node.waiting.popleft()
                if w.phase == "remote":
                    w.todo = 1  # the prompt's last token is computed here (a connector never loads it)
                else:
                    r.engine_cached_tokens = hit
                    w.todo = r.prompt_tokens - hit
                w.chunk = min(w.todo, budget)
                budget -= w.chunk
                prefill_tokens += w.chunk
                ctx_pairs += w.chunk * (r.prompt_tokens - w.todo)
                new_pairs += w.chunk * w.chunk / 2
                node.prefilling.append(w)
                chunked.append(w)
            self._kv(node)
            decoding = len(node.running) - len(stalled)
            if decoding == 0 and not chunked and node.running:
                # every running request is out of blocks: the newest gives its blocks back and waits at
                # the head of the queue (vLLM preempts the same way; its recomputation is not charged here)
                w = node.running.pop(next(reversed(node.running)))
                self._preempt(node, w, s)
                due = [x for x in stalled if x is not w]
                continue
            break
        self._stall(node, stalled, s)
        if not decoding and not chunked:
            if node.busy:
                node.busy = False
                self._neighbours_changed(node)
            return
        was_busy, node.busy = node.busy, True
        node.decoding = decoding
        node.admitted = chunked
        stalled_ctx = sum(w.req.prompt_tokens + s - w.base for w in stalled)
        ctx = node.ctx_const + s * len(node.running) - stalled_ctx
        self._seq += 1
        # the KV the step's decodes read: every block held on the node, each once however many share it
        kv = (pool.num_blocks - 1 - pool.free_blocks) * pool.block_size if decoding else 0
        node.work_left = node.step.step_s(prefill_tokens, decoding, ctx, ctx_pairs, new_pairs, kv)
        node.mark = self.now
        node.speed = self._speed(node)
        node.end_seq = self._seq
        heapq.heappush(self._events, (self.now + node.work_left / node.speed, self._seq, _STEP, node))
        if not was_busy:
            self._neighbours_changed(node)

    def _stall(self, node: SimNode, stalled: list[Work], s: int) -> None:
        """Requests that found no block at step ``s`` make no token in it: all they have to come moves a
        step later."""
        for w in stalled:
            self._unschedule(node, w)
            w.base += 1
            node.ctx_const -= 1
            w.req.stalls.append((node.number, s))
            w.finish_step += 1
            w.grow_step = s + 1
            node.grow_at.setdefault(s + 1, []).append(w)
            node.finish_at.setdefault(w.finish_step, []).append(w)

    @staticmethod
    def _speed(node: SimNode) -> float:
        """Share of its lone speed ``node``'s step runs at with its host's other nodes as busy as now."""
        return 1.0 / node.step.slowdown(sum(m.busy for m in node.neighbours))

    def _neighbours_changed(self, node: SimNode) -> None:
        """``node`` started or stopped computing: its host's running steps change speed from now on
        (processor sharing), so each one's end moves; the old end event goes stale."""
        for m in node.neighbours:
            if not m.busy:
                continue
            m.work_left -= (self.now - m.mark) * m.speed
            m.mark = self.now
            m.speed = self._speed(m)
            self._seq += 1
            m.end_seq = self._seq
            heapq.heappush(self._events, (self.now + max(m.work_left, 0.0) / m.speed, self._seq, _STEP, m))

    def _preempt(self, node: SimNode, w: Work, s: int) -> None:
        r = w.req
        self._unschedule(node, w)
        r.generated = s - w.base
        if s - 1 >= w.first_step:
            r.spans.append((node.number, w.first_step, s - 1))
        node.ctx_const -= r.prompt_tokens - w.base
        node.pool.free(r.request_id)
        self._kv(node)
        node.waiting.appendleft(w)
        self.preemptions += 1

    def _end_step(self, node: SimNode) -> None:
        s = node.steps
        node.step_end.append(self.now)
        node.steps = s + 1
        for w in node.finish_at.pop(s, ()):
            self._finish(node, w, s)
        for w in node.admitted:
            w.todo -= w.chunk
            if w.todo > 0:  # more of its prompt to compute in later steps
                continue
            node.prefilling.remove(w)
            r = w.req
            if w.phase == "prefill":
                d = r.decision
                assert d is not None and d.prefill is not None
                self._track(d.prefill.node_id, -1)
                self._at(self.now + node.step.transfer_s(r.prompt_tokens), _TRANSFER, (node, r))
                continue
            # its first token (or the first since a preemption) is made by this step
            self._seq += 1
            w.seq = self._seq
            w.base = s - r.generated
            w.first_step = s
            if r.first_token_s is None:
                r.first_token_s = self.now
                d = r.decision
                assert d is not None
                self.policy.on_prefilled(d)  # as the router does when a stream's first event arrives
                if self.record:
                    self.log.append(("prefilled", d))
            w.finish_step = w.base + r.output_tokens - 1
            if w.finish_step <= s:
                node.running[w.seq] = w
                node.ctx_const += r.prompt_tokens - w.base
                self._finish(node, w, s)
                continue
            node.running[w.seq] = w
            node.ctx_const += r.prompt_tokens - w.base
            node.finish_at.setdefault(w.finish_step, []).append(w)
            self._schedule_grow(node, w, r.prompt_tokens, s + 1)  # admission holds the prompt's blocks
        node.admitted = []
        # the step's KV events: what it computed (and what finished requests filled) is now in the
        # router's view; blocks the next step admits stay out of it until that step ends
        node.pool.publish()
        self._kv(node)
        self._start_step(node)

    def _finish(self, node: SimNode, w: Work, s: int) -> None:
        r = w.req
        r.generated = r.output_tokens
        r.finish_s = self.now
        r.spans.append((node.number, w.first_step, s))
        del node.running[w.seq]
        node.ctx_const -= r.prompt_tokens - w.base
        if w.grow_step > s:
            lst = node.grow_at.get(w.grow_step)
            if lst is not None and w in lst:
                lst.remove(w)
                if not lst:
                    del node.grow_at[w.grow_step]
        n = r.prompt_tokens + r.output_tokens - 1  # the last token's KV slot (cached if its block filled)
        node.pool.grow(r.request_id, r.all_keys(n, node.pool.block_size), n)
        node.pool.free(r.request_id)
        self._kv(node)
        d = r.decision
        assert d is not None
        self._track(d.decode.node_id, -1)
        self.policy.on_complete(d)
        if self.record:
            self.log.append(("done", d))
        else:
            r.keys = []
            r._all_keys = None
        self._pending -= 1
        if self._children:
            self._next_turns(r)

    def _transferred(self, prefill: SimNode, r: SimRequest) -> None:
        prefill.pool.free(r.request_id)  # the lease ends: P's blocks stay cached, evictable
        self._kv(prefill)
        if not prefill.busy and prefill.waiting:  # it may have been waiting for these blocks
            self._start_step(prefill)
        d = r.decision
        assert d is not None
        self._enqueue(self._by_id[d.decode.node_id], Work(r, "remote"))

    # --- reading the results --------------------------------------------------------------------
    def token_times(self, r: SimRequest) -> np.ndarray:
        """When each of ``r``'s tokens was made (simulated seconds)."""
        parts = []
        stalls = set(r.stalls)
        for number, first, last in r.spans:
            ends = np.asarray(self.nodes[number].step_end[first : last + 1])
            if stalls:
                keep = [k for k in range(first, last + 1) if (number, k) not in stalls]
                ends = np.asarray([self.nodes[number].step_end[k] for k in keep])
            parts.append(ends)
        return np.concatenate(parts) if parts else np.zeros(0)
