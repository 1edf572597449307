"""``tandem bench sim``'s real half, measured: a configuration's profile taken on its own cluster (a step
model per node kind, each engine alone; how much a busy neighbour slows a step; what the router adds; for
P/D the handover against prompt length), and the CPU that processes outside the benchmark take meanwhile.
The module docstring of ``bench.sim`` says why each is measured the way it is."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import psutil

from contracts.registry import Role
from contracts.secret import engine_auth_headers
from node_agent.model import default_model_dir
from profiling.fit import fit_step_model, nnls
from profiling.measure import first_tokens, measure, neighbour_slowdown
from simulator.step_model import Profile, StepModel

if TYPE_CHECKING:
    from bench.sim import Arm, LiveNodeView, Say, SimBenchConfig


class CpuMeter:
    """How much CPU processes outside this benchmark took during a phase (another job on a shared host
    slows the engines; a profile measured under one load and a replay run under another disagree, and
    the record should show it). Cores busy: all of the machine's busy time less this process tree's."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        t = psutil.cpu_times()
        busy = t.user + t.system + t.nice + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        ours = 0.0
        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                c = p.cpu_times()
                ours += c.user + c.system
        return time.monotonic(), busy, ours

    def lap(self) -> dict[str, float]:
        """Since the last lap: seconds, cores busy in all, cores busy outside this benchmark."""
        (t0, b0, o0), (t1, b1, o1) = self._start, self._read()
        self._start = (t1, b1, o1)
        span = max(t1 - t0, 1e-9)
        return {
            "seconds": round(t1 - t0, 1),
            "cores_busy": round((b1 - b0) / span, 2),
            "cores_busy_elsewhere": round(max(0.0, (b1 - b0) - (o1 - o0)) / span, 2),
        }


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return int(2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * width)


def _metric(text: str, name: str) -> float:
    """Sum of a metric's samples in a Prometheus exposition (every engine label)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


PULL_SECONDS, PULL_COUNT = "tandem_kv_transfer_seconds_sum", "tandem_kv_transfer_seconds_count"


async def _pulls(client: httpx.AsyncClient, decode_url: str, count_before: float, n: int) -> tuple[float, float]:
    """(pull seconds, pulls) on the decode engine once ``n`` more pulls than ``count_before`` show: its
    metrics come from the engine's stats stream, a little after the answer (no notification exists)."""
    deadline = time.monotonic() + 30
    while True:
        text = (await client.get(f"{decode_url}/metrics")).text
        count = _metric(text, PULL_COUNT)
        if count >= count_before + n or time.monotonic() > deadline:
            return _metric(text, PULL_SECONDS), count
        await asyncio.sleep(0.2)


TINY_TOKENS = 16
"""Prompt of the paired requests that time the router and the handover: so short that its prefill
varies little between two requests."""


async def profile_arm(
    arm: Arm, nodes: Sequence[LiveNodeView], router_url: str, model: str, cfg: SimBenchConfig, seed: int, say: Say
) -> tuple[Profile, dict[str, Any]]:
    """The configuration's profile, measured on it: a step model per node kind (each engine alone), how
    much a busy neighbour on the host slows a step, the router's overhead, and for P/D the handover
    against prompt tokens."""
    auth = engine_auth_headers(loopback_only=True)
    models, raw = await _step_models(arm, nodes, model, cfg, seed, say, auth)
    rng = random.Random(seed + 100)
    # the engine that serves a request the router sends whole: the decode node in a P/D cluster
    local = next(n for n in nodes if n.role is (Role.DECODE if arm.prefill else Role.BOTH))
    others = [n.url for n in nodes if n is not local]
    if others:
        raw["neighbours"] = await _neighbours(arm, local, others, model, cfg, seed, say, auth)
    prefill = next((n for n in nodes if n.role is Role.PREFILL), None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        router_s, pairs = await _router_pairs(arm, client, local, prefill, router_url, model, cfg, rng, say, auth)
        raw["router"] = {"tiny_tokens": TINY_TOKENS, **pairs, "router_s": router_s}
        models = {r: replace(m, request_overhead_s=m.request_overhead_s + router_s) for r, m in models.items()}
        say(f"{arm.name}: the router adds {router_s * 1e3:.1f} ms a request")
        if prefill is not None:
            handover = Handover(client, local, prefill, router_url, model, cfg, rng, auth)
            models[Role.PREFILL], raw["handover"] = await handover.fit(models, pairs, router_s, arm, say)
    desc = f"measured on the {arm.name} cluster of tandem bench sim (its engines at once), {cfg.dtype}"
    return Profile(models=models, description=desc, measurements=raw), raw


async def _step_models(
    arm: Arm,
    nodes: Sequence[LiveNodeView],
    model: str,
    cfg: SimBenchConfig,
    seed: int,
    say: Say,
    auth: dict[str, str],
) -> tuple[dict[Role, StepModel], dict[str, Any]]:
    """Each engine swept alone (the others idle), one step model fitted per node kind from its nodes'
    points; the points and the fit's error kept for the record."""
    base = StepModel(kv_bytes_per_token=kv_bytes_per_token(default_model_dir(), cfg.dtype))
    measured = []
    for k, n in enumerate(nodes):
        say(f"{arm.name}: profiling {n.node_id} (the other engines idle)")
        measured.append(
            await measure(
                n.url, model, cfg.sweep, seed=seed + k, headers=auth, progress=lambda m, n=n: say(f"  {n.node_id}: {m}")
            )
        )
    models: dict[Role, StepModel] = {}
    raw: dict[str, Any] = {}
    for role in dict.fromkeys(n.role for n in nodes):
        mine = [m for n, m in zip(nodes, measured, strict=True) if n.role is role]
        pre = [p for m in mine for p in m.prefill]
        dec = [d for m in mine for d in m.decode]
        mix = [x for m in mine for x in m.mixed]
        step, err = fit_step_model(
            pre, dec, mix, base=base, source=f"measured on the {arm.name} cluster's {role.value} nodes"
        )
        models[role] = step
        raw[role.value] = {
            "prefill": [asdict(p) for p in pre],
            "decode": [asdict(d) for d in dec],
            "mixed": [asdict(x) for x in mix],
            "fit_rel_rms": err,
        }
        say(
            f"{arm.name} {role.value}: base {step.base_s * 1e3:.1f} ms, "
            f"prefill {step.prefill_s_per_token * 1e3:.2f} ms/token"
            f" + {step.prefill_s_per_ctx_pair * 1e9:.2f}/{step.prefill_s_per_new_pair * 1e9:.2f} ns a cached/new pair,"
            f" decode {step.decode_s_per_seq * 1e3:.2f} ms/seq"
            f" + {step.decode_s_per_ctx_token * 1e9:.1f} ns/ctx token + {step.decode_s_per_kv_token * 1e9:.1f} ns/KV"
            f" token held, overhead {step.request_overhead_s * 1e3:.1f} ms;"
            f" fit relative RMS {err:.1%}"
        )
    return models, raw


async def _neighbours(
    arm: Arm,
    local: LiveNodeView,
    others: list[str],
    model: str,
    cfg: SimBenchConfig,
    seed: int,
    say: Say,
    auth: dict[str, str],
) -> dict[str, Any]:
    """How much slower ``local`` steps beside busy neighbours. Recorded, not applied: three runs on a
    2-core host measured a decode step 1.11, 1.65 and 1.08x and a prefill 0.94-1.04x slower beside a busy
    neighbour, within this host's step noise (one decode batch swings 2x on its own), and the 1.31x of
    the second run, applied, put the 1P+1D replay's simulated ITL p50 at 174 ms against a real 116 (153
    ms with 1.0). The simulator's processor sharing stays for hosts where a profile measures a real
    effect (``StepModel.shared_slowdown``)."""
    say(f"{arm.name}: {local.node_id} alone and beside busy neighbours")
    slow = await neighbour_slowdown(
        local.url, others, model, seed=seed + 200, headers=auth, vocab=cfg.sweep.vocab, progress=lambda m: say(f"  {m}")
    )
    say(
        f"{arm.name}: beside a busy neighbour a decode step took {slow.decode:.2f}x, a prefill "
        f"{slow.prefill:.2f}x (recorded, not applied)"
    )
    return {**asdict(slow), "decode": slow.decode, "prefill": slow.prefill, "factor": slow.factor}


async def _router_pairs(
    arm: Arm,
    client: httpx.AsyncClient,
    local: LiveNodeView,
    prefill: LiveNodeView | None,
    router_url: str,
    model: str,
    cfg: SimBenchConfig,
    rng: random.Random,
    say: Say,
    auth: dict[str, str],
) -> tuple[float, dict[str, list[float]]]:
    """What the router adds, both ways (its work and its hop; the engines' own HTTP is in the fit): tiny
    prompts straight to the engine and through the router, interleaved; for P/D also straight to the
    prefill engine and disaggregated, which the handover's fit starts from."""
    pairs: dict[str, list[float]] = {"direct": [], "routed": [], "direct_prefill": [], "pd": []}
    say(f"{arm.name}: {TINY_TOKENS}-token prompts straight to the engines and through the router, interleaved")
    for _ in range(4 * cfg.sweep.repeats):
        legs = [("direct", local.url, auth), ("routed", router_url, {"x-tandem-route": "colocated"})]
        if prefill is not None:
            legs += [("direct_prefill", prefill.url, auth), ("pd", router_url, {"x-tandem-route": "disaggregated"})]
        for key, url, headers in legs:
            (point,) = await first_tokens(client, url, model, (TINY_TOKENS,), 1, rng, cfg.sweep.vocab, headers)
            pairs[key].append(point.seconds)
    return max(0.0, float(np.median(pairs["routed"]) - np.median(pairs["direct"]))), pairs


@dataclass
class Handover:
    """The P/D handover: what a P/D request's first token takes beyond the same prompt's prefill sent
    straight to the prefill engine, less the router and the decode node's step that computes the prompt's
    last token. Timed in pairs (straight, then P/D, in turn, so that the host's load drifts out of the
    difference), because the router's pairs are layer-wise: the decode node pulls each layer while the
    prefill computes the next, so the pull's own time (tandem_kv_transfer_seconds, kept in the record)
    spans the prefill and says nothing of what the transfer adds after it. Taken for the transfer, it
    charged every simulated P/D request its prefill twice (in one recorded run: P/D TTFT p90 1.04 off)."""

    client: httpx.AsyncClient
    decode: LiveNodeView
    prefill: LiveNodeView
    router_url: str
    model: str
    cfg: SimBenchConfig
    rng: random.Random
    auth: dict[str, str]

    async def fit(
        self, models: dict[Role, StepModel], pairs: dict[str, list[float]], router_s: float, arm: Arm, say: Say
    ) -> tuple[StepModel, dict[str, Any]]:
        """The prefill kind's step model with its transfer coefficients fitted, and the record."""
        d, p = models[Role.DECODE], models[Role.PREFILL]
        pull_s0, pulls_n0 = await _pulls(self.client, self.decode.url, 0, 0)
        extra: dict[int, list[float]] = {
            TINY_TOKENS: [q - s for q, s in zip(pairs["pd"], pairs["direct_prefill"], strict=True)]
        }
        pd_first = await self._sweep(extra)
        pull_s1, pulls_n1 = await _pulls(self.client, self.decode.url, pulls_n0, len(pd_first) * self.cfg.sweep.repeats)
        handover = {
            n: max(0.0, float(np.median(v)) - router_s - d.step_s(1, 0, 0, n - 1, 0.5)) for n, v in extra.items()
        }
        ns = np.array(sorted(handover), dtype=float)
        fixed, per_token = nnls(np.column_stack([np.ones_like(ns), ns]), np.array([handover[int(n)] for n in ns]))
        bw = p.kv_bytes_per_token / per_token if per_token > 0 else 1e15
        fitted = replace(p, transfer_base_s=float(fixed), transfer_bytes_per_s=float(bw))
        predicted = {
            n: fitted.request_overhead_s
            + fitted.step_s(n, 0, 0, 0.0, n * n / 2)
            + fitted.transfer_s(n)
            + d.step_s(1, 0, 0, n - 1, 0.5)
            for n in pd_first
        }
        say(f"{arm.name}: handover {fixed * 1e3:.1f} ms + {per_token * 1e6:.1f} us/token ({bw / 1e9:.2f} GB/s)")
        return fitted, {
            "pd_less_straight_s": extra,
            "handover_s": handover,
            "fixed_s": float(fixed),
            "s_per_token": float(per_token),
            "pull_mean_s_layerwise_spans_prefill": (pull_s1 - pull_s0) / max(pulls_n1 - pulls_n0, 1),
            "pd_first_token_s": pd_first,
            "pd_first_token_predicted_s": predicted,
        }

    async def _sweep(self, extra: dict[int, list[float]]) -> dict[int, float]:
        """Each sweep length straight and P/D in turn: the differences into ``extra``; the P/D first tokens."""
        pd_first: dict[int, float] = {}
        pd_route = {"x-tandem-route": "disaggregated"}
        vocab = self.cfg.sweep.vocab
        for n in self.cfg.sweep.prefill_tokens:
            straight, paired = [], []
            for _ in range(self.cfg.sweep.repeats):
                (q,) = await first_tokens(
                    self.client, self.prefill.url, self.model, (n,), 1, self.rng, vocab, self.auth
                )
                straight.append(q.seconds)
                (q,) = await first_tokens(self.client, self.router_url, self.model, (n,), 1, self.rng, vocab, pd_route)
                paired.append(q.seconds)
            extra[n] = [q - s for q, s in zip(paired, straight, strict=True)]
            pd_first[n] = float(np.median(paired))
        return pd_first
