"""The P:D planner: which fleet, at least cost, meets the latency targets on this trace. Every figure is
SIMULATED (``simulator.fleet``, the real router's ``cache_aware`` policy, a ``Profile``'s step models).

The search, in simulations of the whole trace (each one a ``FleetSim`` run, ~10 s for the Mooncake
trace at 20,000 requests/s on ~200 nodes):

1. A first size from the work alone: prefill nodes = uncached prompt tokens (the trace's infinite-cache
   ceiling taken off) x prefill seconds per token / trace duration, decode nodes = output tokens x decode
   seconds per token at a batch of 256 / duration; at least one of each.
2. For each layout (aggregated: all nodes colocated; disaggregated at each P share in ``p_shares``), the
   smallest node count on a geometric grid (ratio ``grid``) that meets the targets: doubling up from the
   first size until one meets them, then halving the bracket down (bisection on the grid). Meeting the
   targets is taken to be monotone in the node count (more nodes never hurt), which a run can break
   near the boundary: every run is printed, so a reader sees it. Once a layout has met the targets,
   the next is tried only at sizes that would cost less (a dearer fleet cannot win), from the largest
   such size down: when that one misses, the layout is done in one simulation. On the Mooncake trace
   at 20,000 requests/s this takes the search from 22 simulations (5 min 39 s on this shared host) to
   about half as many, since each disaggregated share used to climb down from ~240 nodes.
3. The cheapest layout that met the targets is tried once more with each other conditional-
   disaggregation threshold (``local_prefill_max_tokens``), at the same and the next smaller size.

Cost = nodes x their unit cost (``node_cost``; 1 per node unless told). Attainment = share of requests
that met every per-request target (TTFT, and the mean gap between its tokens for ITL); goodput = those
requests per second of trace. The percentile targets (``ttft_p90`` ...) are checked on the whole run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from contracts.registry import Role
from router.policies import CacheAware, CacheAwareConfig
from simulator.fleet import SIMULATED, FleetSim, NodeSpec
from simulator.keys import PreparedTrace
from simulator.step_model import Profile
from traces.stats import ceiling


@dataclass(frozen=True)
class SLO:
    """Targets, seconds: metric name (``ttft`` or ``itl``) and percentile -> limit."""

    targets: dict[tuple[str, float], float]

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``ttft_p90=1.5s,itl_p90=50ms`` (units s or ms; bare numbers are seconds)."""
        out: dict[tuple[str, float], float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            metric, _, pct = name.strip().partition("_p")
            if metric not in ("ttft", "itl") or not pct or not value:
                raise ValueError(f"target {part!r}: expected ttft_pNN=VALUE or itl_pNN=VALUE")
            v = value.strip()
            seconds = float(v[:-2]) / 1000 if v.endswith("ms") else float(v.removesuffix("s"))
            out[(metric, float(pct))] = seconds
        if not out:
            raise ValueError("no targets given")
        return cls(out)

    def describe(self) -> str:
        return ", ".join(f"{m}_p{p:g} <= {v * 1e3:.0f} ms" for (m, p), v in self.targets.items())


@dataclass(frozen=True)
class Layout:
    prefill: int
    decode: int
    colocated: int
    local_prefill_max_tokens: int

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode + self.colocated

    def describe(self) -> str:
        if self.colocated:
            return f"aggregated {self.colocated} colocated"
        return f"disaggregated {self.prefill}P+{self.decode}D (local prefill <= {self.local_prefill_max_tokens} tok)"


@dataclass(frozen=True)
class Tried:
    """One simulation of the search (SIMULATED)."""

    layout: Layout
    cost: float
    percentiles: dict[str, float]
    """ttft_p50/p90/p99, itl_p50/p90/p99, seconds."""
    attainment: float
    goodput_rps: float
    hit_rate: float
    meets: bool
    wall_s: float


@dataclass
class Plan:
    trace_requests: int
    trace_duration_s: float
    slo: SLO
    tried: list[Tried] = field(default_factory=list)
    best: Tried | None = None
    wall_s: float = 0.0
    label: str = SIMULATED


def _measure(sim: FleetSim, prep: PreparedTrace, slo: SLO) -> tuple[dict[str, float], float, float, float]:
    reqs = sim.run(prep)
    ttft = np.array([r.first_token_s - r.arrival_s for r in reqs])  # type: ignore[operator]
    gaps, mean_itl = [], np.zeros(len(reqs))
    for i, r in enumerate(reqs):
        t = sim.token_times(r)
        if len(t) > 1:
            g = np.diff(t)
            gaps.append(g)
            mean_itl[i] = g.mean()
    itl = np.concatenate(gaps) if gaps else np.zeros(1)
    pct = {f"ttft_p{p}": float(np.percentile(ttft, p)) for p in (50, 90, 99)}
    pct |= {f"itl_p{p}": float(np.percentile(itl, p)) for p in (50, 90, 99)}
    ok = np.ones(len(reqs), dtype=bool)
    for (metric, _), limit in slo.targets.items():
        ok &= (ttft if metric == "ttft" else mean_itl) <= limit
    prompt = sum(r.prompt_tokens for r in reqs)
    hit = sum(r.engine_cached_tokens for r in reqs) / prompt if prompt else 0.0
    return pct, float(ok.mean()), int(ok.sum()), hit


def plan(
    prep: PreparedTrace,
    profile: Profile,
    slo: SLO,
    *,
    kv_tokens_per_node: int = 4_000_000,
    node_cost: dict[Role, float] | None = None,
    p_shares: tuple[float, ...] = (0.25, 0.5, 0.75),
    thresholds: tuple[int, ...] = (256, 2048),
    grid: float = 1.4,
    max_nodes: int = 2000,
    on_try: Callable[[Tried], None] | None = None,
) -> Plan:
    started = time.monotonic()
    search = _Search(prep, profile, slo, kv_tokens_per_node, node_cost or {}, grid, max_nodes, on_try)
    default_threshold = thresholds[0]
    winners: list[Tried] = []
    agg = search.smallest(lambda n: Layout(0, 0, n, default_threshold))
    if agg:
        winners.append(agg)
    for share in p_shares:

        def make(n: int, share: float = share) -> Layout:
            p = min(max(1, round(n * share)), n - 1)
            return Layout(p, n - p, 0, default_threshold)

        bound = min((t.cost for t in winners), default=math.inf)
        w = search.smallest(make, bound)
        if w:
            winners.append(w)
    out = search.out
    if winners:
        best = min(winners, key=lambda t: (t.cost, -t.attainment))
        if best.layout.colocated == 0:  # 3. the conditional-disaggregation threshold
            for th in thresholds[1:]:
                for shrink in (1.0, 1 / grid):
                    n = max(2, round(best.layout.nodes * shrink))
                    p = min(max(1, round(n * best.layout.prefill / best.layout.nodes)), n - 1)
                    t = search.run(Layout(p, n - p, 0, th))
                    if t.meets:
                        winners.append(t)
        out.best = min(winners, key=lambda t: (t.cost, -t.attainment))
    out.wall_s = time.monotonic() - started
    return out


class _Search:
    """One ``plan`` call's state: every layout tried (each simulated once), the first size from the work,
    and the grid search for the smallest layout of a shape that meets the targets."""

    def __init__(
        self,
        prep: PreparedTrace,
        profile: Profile,
        slo: SLO,
        kv_tokens_per_node: int,
        cost_of: dict[Role, float],
        grid: float,
        max_nodes: int,
        on_try: Callable[[Tried], None] | None,
    ) -> None:
        self.prep, self.profile, self.slo, self.cost_of = prep, profile, slo, cost_of
        self.grid, self.max_nodes, self.on_try = grid, max_nodes, on_try
        arrivals = prep.arrival_s
        self.duration = float(arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else 1.0
        self.out = Plan(trace_requests=len(prep), trace_duration_s=self.duration, slo=slo)
        self.blocks = max(kv_tokens_per_node // prep.block_size, 2)
        self.memo: dict[Layout, Tried] = {}
        self.first = self._first_size()

    def cost(self, layout: Layout) -> float:
        return (
            layout.prefill * self.cost_of.get(Role.PREFILL, 1.0)
            + layout.decode * self.cost_of.get(Role.DECODE, 1.0)
            + layout.colocated * self.cost_of.get(Role.BOTH, 1.0)
        )

    def run(self, layout: Layout) -> Tried:
        """The layout simulated (a layout two shares round to is simulated once)."""
        if layout in self.memo:
            return self.memo[layout]
        bs, blocks = self.prep.block_size, self.blocks
        specs = (
            [NodeSpec(Role.PREFILL, num_blocks=blocks, block_size=bs)] * layout.prefill
            + [NodeSpec(Role.DECODE, num_blocks=blocks, block_size=bs)] * layout.decode
            + [NodeSpec(Role.BOTH, num_blocks=blocks, block_size=bs)] * layout.colocated
        )
        cfg = CacheAwareConfig(local_prefill_max_tokens=layout.local_prefill_max_tokens)
        t0 = time.monotonic()
        sim = FleetSim(specs, lambda lookup: CacheAware(lookup, cfg), step=self.profile)
        pct, att, good, hit = _measure(sim, self.prep, self.slo)
        meets = all(pct[f"{m}_p{p:g}"] <= v for (m, p), v in self.slo.targets.items() if f"{m}_p{p:g}" in pct)
        tried = Tried(layout, self.cost(layout), pct, att, good / self.duration, hit, meets, time.monotonic() - t0)
        self.out.tried.append(tried)
        self.memo[layout] = tried
        if self.on_try is not None:
            self.on_try(tried)
        return tried

    def _first_size(self) -> int:
        """1. a first size from the work: the prefill and decode nodes the trace's tokens keep busy."""
        prep, profile = self.prep, self.profile
        c = ceiling(prep.trace, prep.block_size)
        uncached = c.prompt_tokens - c.hit_tokens
        pm, dm = profile.for_role(Role.PREFILL), profile.for_role(Role.DECODE)
        batch = 256
        per_token_decode = dm.step_s(0, batch, batch * int(np.mean(prep.input_tokens))) / batch
        n_p = max(1, math.ceil(uncached * pm.prefill_s_per_token / self.duration))
        n_d = max(1, math.ceil(float(prep.output_tokens.sum()) * per_token_decode / self.duration))
        return n_p + n_d

    def smallest(self, make: Callable[[int], Layout], below: float = math.inf) -> Tried | None:
        """The smallest size on the grid whose layout meets the targets, among those costing less than
        ``below`` (None: none does)."""
        first = self.first
        sizes = sorted({max(2, round(first * self.grid**k)) for k in range(-8, 30)})
        sizes = [s for s in sizes if s <= self.max_nodes and self.cost(make(s)) < below]
        if not sizes:
            return None
        if below < math.inf:  # a cheaper fleet than the best so far, or nothing: the dearest such one first
            i = len(sizes) - 1
            if not self.run(make(sizes[i])).meets:
                return None
        else:
            i = min(range(len(sizes)), key=lambda k: abs(sizes[k] - first))
        seen: dict[int, Tried] = {}

        def at(k: int) -> Tried:
            if k not in seen:
                seen[k] = self.run(make(sizes[k]))
            return seen[k]

        # lo: largest index known to fail (-1: none), hi: smallest known to meet
        lo, step = -1, 1
        if at(i).meets:
            hi, k = i, i - 1
            while k >= 0:
                if not at(k).meets:
                    lo = k
                    break
                hi, step = k, step * 2
                k = hi - step
        else:
            lo = i
            while True:
                k = min(lo + step, len(sizes) - 1)
                if at(k).meets:
                    hi = k
                    break
                if k == len(sizes) - 1:
                    return None
                lo, step = k, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if at(mid).meets:
                hi = mid
            else:
                lo = mid
        return seen[hi]


def plot(result: Plan, path: str) -> None:
    """Cost against target attainment, one point per simulation, the chosen one ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    agg = [t for t in result.tried if t.layout.colocated]
    dis = [t for t in result.tried if not t.layout.colocated]
    for group, marker, name in ((agg, "s", "aggregated"), (dis, "o", "disaggregated")):
        ax.scatter([t.cost for t in group], [t.attainment for t in group], marker=marker, label=name, alpha=0.7)
    for t in result.tried:
        if t.meets:
            ax.scatter([t.cost], [t.attainment], s=80, facecolors="none", edgecolors="green")
    if result.best:
        b = result.best
        ax.scatter([b.cost], [b.attainment], s=250, facecolors="none", edgecolors="red", linewidths=2)
        ax.annotate(b.layout.describe(), (b.cost, b.attainment), textcoords="offset points", xytext=(8, -14))
    ax.set_xlabel("cost (nodes)")
    ax.set_ylabel("requests meeting every target")
    ax.set_title(f"SIMULATED plan: {result.slo.describe()} (green: percentile targets met)", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
