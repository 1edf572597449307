"""``tandem bench agents``: coding-agent sessions shaped like Codex CLI's and Claude Code's, through each
API (Chat Completions, Responses, Messages), against `tandem up` and against the bare engines' own
endpoints on the same engines.

One cluster (``tandem up``'s P/D default: 1 prefill + 1 decode node, ``infra.launcher``) serves every
arm, one after another:

    tandem_<api>   the router's endpoint of that API
    engine_<api>   the engines' own endpoint of that API (vLLM serves all three), with their API key;
                   session i goes to engine i mod n and stays there, each engine prefilling and
                   decoding itself, as a client that spreads its sessions over plain ``vllm serve``
                   instances would

Sessions (``bench.agent_workload``, re-encoded per API by ``bench.agent_apis``): a long system prompt
and a tool list shared by every session, a repository context shared by the sessions of that
repository, then turns that each add the agent's answer with a tool call and the tool's result, the
whole history resent; pauses while the tool runs; at most ``concurrency`` sessions at once. Every arm
has its own content (a salt in the system prompt), so no arm warms another; rounds alternate the order.

Two more arms compare the transports on the same sessions (``bench.agent_socket``):
``tandem_responses-chain`` (SSE, chained by ``previous_response_id``) and ``tandem_responses-ws`` (the
same chain on one WebSocket per session).

Per arm (every round pooled): TTFT p50/p99, ITL p50/p99 (gaps between text deltas as the client reads
them), session completion time p50/p99 (first turn sent to last answer read), hit (cached prompt tokens
over prompt tokens, from each API's own usage), errors and the first error messages; and the per-turn
overhead: mean TTFT minus the mean time to first token of the engines that stream the answers (decode
and colocated nodes: the growth of their ``vllm:time_to_first_token_seconds`` sum over the arm, divided
by the arm's answered turns). A decode engine's own TTFT runs from the request's arrival there, which a
layer-wise P/D pair sends with the prefill leg, so it holds the prefill, the transfer and its queue; what
is left is what the path between the client and the engines adds. (Summing every engine's queue and
prefill time counts the pair's overlap twice.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets

from bench.agent_apis import APIS, BODIES, PATHS, SESSION_HEADERS, one_turn, structure
from bench.agent_socket import CHAINED, chained_body, new_items, socket_turn
from bench.agent_workload import AgentWorkloadConfig, build_sessions
from bench.charts import grouped_bars, save, subplots
from bench.loadgen import RequestResult, SessionScript, percentile
from bench.routing import _Tokens
from contracts.config import redis_url as configured_redis_url
from contracts.secret import engine_auth_headers
from infra.launcher import Cluster, ClusterSpec

TARGETS = ("tandem", "engine")
ENGINE_TIME = ("vllm:time_to_first_token_seconds_sum",)


def _workload() -> AgentWorkloadConfig:
    # Agent-shaped and quick: a 1.5k-token system prompt every session shares, two repositories of
    # 600 tokens, four turns with tool outputs of 60-160 tokens and 1 s tool pauses.
    return AgentWorkloadConfig(
        repos=2,
        sessions_per_repo=2,
        turns_min=4,
        turns_max=4,
        system_tokens=1500,
        repo_tokens=600,
        tool_tokens=(60, 160),
        reply_tokens=(15, 35),
        think_s=1.0,
    )


@dataclass(frozen=True)
class AgentsBenchConfig:
    apis: tuple[str, ...] = (*APIS, *CHAINED)
    targets: tuple[str, ...] = TARGETS
    rounds: int = 1
    workload: AgentWorkloadConfig = field(default_factory=_workload)
    concurrency: int = 4
    """Sessions in flight at once (the agent pool)."""
    max_tokens: int = 16
    max_think_s: float = 2.0
    prefill: int = 1
    decode: int = 1
    model: str | None = None
    port_base: int = 23200
    """Nodes use port_base + 10 * i, the router port_base + 50."""
    redis_url: str = field(default_factory=lambda: configured_redis_url(db=13))
    workdir: Path = Path(".tandem/bench-agents")

    @property
    def arms(self) -> tuple[str, ...]:
        # A chain or a socket needs the router (the engines keep no chain without a store, and no socket).
        return tuple(f"{t}_{a}" for a in self.apis for t in self.targets if t == "tandem" or a not in CHAINED)


@dataclass
class Turn:
    """One request of an arm's run, as the client saw it."""

    session_id: str
    turn: int
    result: RequestResult


@dataclass
class ArmRun:
    arm: str
    round: int
    turns: list[Turn]
    session_s: dict[str, float]
    """Session id -> seconds from its first turn sent to its last answer read (complete sessions only)."""
    wall_s: float
    engine_s: float = 0.0
    """The streaming engines' time to first token over the run, summed (their own histograms)."""


# -- summaries -------------------------------------------------------------------------------------------
def _ms(values: Sequence[float], q: float) -> float | None:
    return round(percentile(values, q) * 1000, 1) if values else None


def summarize(runs: Sequence[ArmRun]) -> dict[str, Any]:
    """One arm's figures over its runs."""
    done = [t.result for r in runs for t in r.turns]
    ok = [x for x in done if x.ok]
    itl = [g for x in ok for g in x.itl_s]
    sessions = [s for r in runs for s in r.session_s.values()]
    prompt = sum((x.usage or {}).get("prompt_tokens", 0) for x in ok)
    cached = sum((x.usage or {}).get("cached_tokens", 0) for x in ok)
    errors = [x.error or "" for x in done if not x.ok]
    overhead = None
    if ok:
        overhead = round((sum(x.ttft_s for x in ok) - sum(r.engine_s for r in runs)) / len(ok) * 1000, 1)
    return {
        "requests": len(done),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "sessions_complete": len(sessions),
        "ttft_p50_ms": _ms([x.ttft_s for x in ok], 0.5),
        "ttft_p99_ms": _ms([x.ttft_s for x in ok], 0.99),
        "itl_p50_ms": _ms(itl, 0.5),
        "itl_p99_ms": _ms(itl, 0.99),
        "session_p50_s": round(percentile(sessions, 0.5), 2) if sessions else None,
        "session_p99_s": round(percentile(sessions, 0.99), 2) if sessions else None,
        "hit": round(cached / prompt, 3) if prompt else None,
        "overhead_ms": overhead,
        "prompt_tokens": prompt,
        "wall_s": round(sum(r.wall_s for r in runs), 1),
    }


RESULT_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "session_p50_s", "hit", "overhead_ms", "errors")


WS_OVERHEAD_TARGET = 0.7
"""Issue 39: a socket's per-turn overhead at most this share of the same chained sessions' over SSE."""


def transport_verdict(arms: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The socket arm's per-turn overhead over the SSE chain arm's, when the run had both."""
    ws, sse = arms.get("tandem_responses-ws"), arms.get("tandem_responses-chain")
    if not ws or not sse or not ws["overhead_ms"] or not sse["overhead_ms"]:
        return None
    ratio = round(ws["overhead_ms"] / sse["overhead_ms"], 3)
    return {"ws_over_sse_overhead": ratio, "target": WS_OVERHEAD_TARGET, "held": ratio <= WS_OVERHEAD_TARGET}


def result_line(result: dict[str, Any]) -> str:
    """``RESULT agents <arm>_<figure>=… …`` over every arm, in the run's arm order, then the transport
    verdict when the run had both chained arms."""
    parts = [f"{arm}_{k}={figures[k]}" for arm, figures in result["arms"].items() for k in RESULT_KEYS]
    verdict = result.get("transport")
    if verdict:
        parts += [f"ws_over_sse_overhead={verdict['ws_over_sse_overhead']}", f"ws_target_held={verdict['held']}"]
    return "RESULT agents " + " ".join(parts)


# -- one arm's run ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Where an arm sends its sessions: base URLs (one per session, round-robin) and their headers."""

    urls: tuple[str, ...]
    headers: dict[str, str]


async def run_arm(
    arm: str, rnd: int, target: Target, model: str, scripts: Sequence[SessionScript], cfg: AgentsBenchConfig
) -> ArmRun:
    """Replay ``scripts`` through one arm (``<target>_<api>``): each session's turns in order, its tool
    pauses between them, at most ``cfg.concurrency`` sessions at once."""
    api = arm.split("_", 1)[1]
    turns: list[Turn] = []
    session_s: dict[str, float] = {}
    slots = asyncio.Semaphore(cfg.concurrency)

    async def session(client: httpx.AsyncClient, k: int, s: SessionScript) -> None:
        if api in CHAINED:
            return await chained(client, target.urls[k % len(target.urls)], s)
        url = target.urls[k % len(target.urls)] + PATHS[api]
        headers = {**target.headers, SESSION_HEADERS[api]: s.session_id}
        async with slots:
            start = time.perf_counter()
            for i, messages in enumerate(s.turns):
                system, items = structure(messages)
                body = BODIES[api](model, system, items, cfg.max_tokens)
                result = await one_turn(client, api, url, body, headers)
                turns.append(Turn(s.session_id, i, result))
                if not result.ok:
                    return
                if i < len(s.think_s):
                    await asyncio.sleep(min(s.think_s[i], cfg.max_think_s))
            session_s[s.session_id] = time.perf_counter() - start

    async def chained(client: httpx.AsyncClient, base: str, s: SessionScript) -> None:
        headers = {**target.headers, SESSION_HEADERS["responses"]: s.session_id}
        async with slots, contextlib.AsyncExitStack() as stack:
            ws = None
            if api == "responses-ws":
                url = base.replace("http://", "ws://") + PATHS["responses"]
                ws = await stack.enter_async_context(websockets.connect(url, additional_headers=headers))
            start, previous = time.perf_counter(), None
            for i, messages in enumerate(s.turns):
                system, items = structure(messages)
                body = chained_body(model, system, items, new_items(messages), previous, cfg.max_tokens, ws is None)
                if ws is not None:
                    result, previous = await socket_turn(ws, body)
                else:
                    ids: list[str] = []
                    result = await one_turn(client, "responses", base + PATHS["responses"], body, headers, ids)
                    previous = ids[-1] if ids else None
                turns.append(Turn(s.session_id, i, result))
                if not result.ok or previous is None:
                    return
                if i < len(s.think_s):
                    await asyncio.sleep(min(s.think_s[i], cfg.max_think_s))
            session_s[s.session_id] = time.perf_counter() - start

    start = time.perf_counter()
    limits = httpx.Limits(max_connections=len(scripts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        await asyncio.gather(*(session(client, k, s) for k, s in enumerate(scripts)))
    return ArmRun(arm, rnd, turns, session_s, time.perf_counter() - start)


# -- the cluster and the run -----------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"[agents {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _cluster(cfg: AgentsBenchConfig) -> Iterator[Cluster]:
    spec = ClusterSpec(
        prefill=cfg.prefill,
        decode=cfg.decode,
        model=cfg.model,
        router_port=cfg.port_base + 50,
        node_base_port=cfg.port_base,
        redis_url=cfg.redis_url,
        workdir=cfg.workdir / "cluster",
        router_env=(("TANDEM_DATABASE_URL", f"sqlite:///{(cfg.workdir / 'router.db').resolve()}"),),
    )
    with Cluster(spec) as cluster:
        yield cluster


def _engine_seconds(engines: Sequence[str]) -> float:
    """The engines' summed time to first token of every request so far (their own histograms)."""
    auth = engine_auth_headers(loopback_only=True)
    total = 0.0
    for url in engines:
        for line in httpx.get(f"{url}/metrics", headers=auth, timeout=10).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.split("{", 1)[0] in ENGINE_TIME:
                total += float(value)
    return total


def _warm(cluster: Cluster, engines: Sequence[str], model: str) -> None:
    """One short turn of every API on every engine and through the router: no arm pays a first request."""
    system, items = structure([{"role": "system", "content": "warm"}, {"role": "user", "content": "warm up"}])
    auth = engine_auth_headers(loopback_only=True)

    async def warm() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            for api in APIS:
                body = BODIES[api](model, system, items, 2)
                for base, headers in [(cluster.url, {}), *((e, auth) for e in engines)]:
                    result = await one_turn(client, api, base + PATHS[api], body, headers)
                    if not result.ok:
                        _log(f"warm-up {api} at {base}: {result.error}")

    asyncio.run(warm())


def run_agents_bench(out: Path, cfg: AgentsBenchConfig | None = None) -> dict[str, Any]:
    cfg = cfg or AgentsBenchConfig()
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = _Tokens(cfg.model)
    nonce = uuid.uuid4().hex[:6]
    runs: list[ArmRun] = []
    load = {"before": os.getloadavg()}
    with _cluster(cfg) as cluster:
        engines = tuple(cluster.role_urls("prefill") + cluster.role_urls("decode") + cluster.role_urls("both"))
        streaming = tuple(cluster.role_urls("decode") + cluster.role_urls("both"))
        resp = httpx.get(f"{cluster.url}/v1/models", timeout=30)
        resp.raise_for_status()
        model = str(resp.json()["data"][0]["id"])
        _warm(cluster, engines, model)
        targets = {
            "tandem": Target((cluster.url,), {}),
            "engine": Target(engines, engine_auth_headers(loopback_only=True)),
        }
        for rnd in range(cfg.rounds):
            order = cfg.arms if rnd % 2 == 0 else tuple(reversed(cfg.arms))
            for arm in order:
                salt = f"agents-{nonce}-r{rnd}-{arm}"
                scripts = build_sessions(cfg.workload, salt, tokens.text, lambda m: len(tokens.prompt(m)))
                _log(f"r{rnd} {arm}: {len(scripts)} sessions (load {os.getloadavg()[0]:.2f})")
                # Through the router the decode and colocated engines stream; an engine arm's every engine.
                answering = streaming if arm.startswith("tandem_") else engines
                before = _engine_seconds(answering)
                run = asyncio.run(run_arm(arm, rnd, targets[arm.split("_", 1)[0]], model, scripts, cfg))
                run.engine_s = _engine_seconds(answering) - before
                runs.append(run)
                one = summarize([run])
                _log(
                    f"r{rnd} {arm}: {run.wall_s:.1f} s, TTFT p50/p99 {one['ttft_p50_ms']}/{one['ttft_p99_ms']} ms, "
                    f"ITL p50 {one['itl_p50_ms']} ms, session p50 {one['session_p50_s']} s, hit {one['hit']}, "
                    f"overhead {one['overhead_ms']} ms, "
                    f"errors {one['errors']} {one['error_samples'][:1]}"
                )
    load["after"] = os.getloadavg()
    arms = {arm: summarize([r for r in runs if r.arm == arm]) for arm in cfg.arms}
    result = {
        "benchmark": "agents",
        "config": {**dataclasses.asdict(cfg), "workdir": str(cfg.workdir)},
        "host": {"cores": len(os.sched_getaffinity(0)), "loadavg": load},
        "model": model,
        "engines": list(engines),
        "arms": arms,
        "per_run": {f"r{r.round}-{r.arm}": summarize([r]) for r in runs},
        "transport": transport_verdict(arms),
    }
    out.write_text(json.dumps(result, indent=2, default=str))
    plot(arms, out.with_suffix(".png"))
    return result


def plot(arms: dict[str, dict[str, Any]], png: Path) -> None:
    names = list(arms)
    panels = [
        ("TTFT p50 / p99 (ms)", ["ttft_p50_ms", "ttft_p99_ms"]),
        ("ITL p50 / p99 (ms)", ["itl_p50_ms", "itl_p99_ms"]),
        ("session completion p50 / p99 (s)", ["session_p50_s", "session_p99_s"]),
        ("hit rate (cached / prompt tokens)", ["hit"]),
        ("per-turn overhead (ms): TTFT - streaming engine's TTFT", ["overhead_ms"]),
        ("errors", ["errors"]),
    ]
    fig, axes = subplots(1, len(panels), (4 * len(panels), 4.5))
    for ax, (title, keys) in zip(axes.flat, panels, strict=True):
        grouped_bars(
            ax, {key: [arms[n][key] or 0 for n in names] for key in keys}, [n.replace("_", "\n") for n in names]
        )
        ax.set_title(title, fontsize=10)
    fig.suptitle("tandem bench agents: agent sessions per API, Tandem's router vs the engines' own endpoints")
    save(fig, png)


__all__ = ["TARGETS", "AgentsBenchConfig", "ArmRun", "Turn", "result_line", "run_agents_bench", "summarize"]
