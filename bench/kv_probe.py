"""TTFT at the workload's longest shared prefix, by where the prefix comes from, on an idle cluster.

The arms' own TTFT medians by origin mix load into the comparison (a remote hit that queued behind a
miss reads slower than a local hit that did not). This probe takes the load out: on two colocated nodes
A and B, for each of ``n`` fresh prefixes (a new salt, so no block of it is cached anywhere) as long as
the workload's system prompt plus one repository's context, three requests one after the other, each
pinned with the admin header ``x-tandem-node`` (``router.edge.exchange.node_pin``):

    miss     on A, the first sight of the prefix: computed
    local    on A again, another task after the same prefix: A's own cache
    remote   on B, which never saw it: B loads it from the host tier (A offloaded it when its request
             ended) or from A (cross-node reuse, ``router.planning.peer_fetch``)

Each request's prefix is the same; only the task after it differs, so the three compute the same few
uncached tokens apart from what the origin supplies. No wait is needed between them: A's blocks reach
the tier in the engine step after its request ends, and the next request is scheduled in that step or
later. The medians per kind are taken over the requests whose ``usage.tandem.kv_origin`` says most of
the prompt came from where the kind says (a remote request B computed is not a remote hit), and the
counts say how many that was.

Every measured request runs on an engine that has just served one: a node whose last request was not
the one before it (A before its miss, B before its remote hit) first serves a warm-up, a completion of
a few tokens (not measured). An engine's step queues spin for a while after each step and then sleep
(``TANDEM_ENGINE_SPIN_MS``, a one-core node's default 1 s): without the warm-up, the local hit ran on
A still spinning from the miss, and the remote hit on B asleep since the prefix before, so their ratio
measured B's wake-up as well as the load from the tier. The warm-up is shorter than one KV block, so
it stores nothing in the tier: a warm-up of two blocks (a chat request, with its template) evicted the
two oldest spares of a full tier, which were the probed prefix's own tail (``host_tier.eviction``: a
finished request's chain becomes spares tail first), and B then computed what it should have loaded.
"""

from __future__ import annotations

import asyncio
import statistics
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from bench.agent_workload import AgentWorkloadConfig, shared_context
from bench.loadgen import RequestResult, one_request

KINDS = ("miss", "local", "remote")
ORIGIN = {"miss": ("computed",), "local": ("engine",), "remote": ("host_tier", "peer")}
"""Which ``kv_origin`` entries a kind's request should have most of its prompt from."""


def came_as_expected(result: RequestResult, kind: str) -> bool:
    usage = result.usage or {}
    origin = (usage.get("tandem") or {}).get("kv_origin") or {}
    prompt = usage.get("prompt_tokens") or 0
    return result.ok and prompt > 0 and sum(origin.get(k, 0) for k in ORIGIN[kind]) >= 0.5 * prompt


WARM_UP = "Warm up."
"""The warm-up's whole prompt: a few tokens, no chat template, so no full KV block to store."""


async def _probe(
    url: str,
    model: str,
    nodes: tuple[str, str],
    prompts: list[Callable[[str], list[dict[str, str]]]],
    max_tokens: int,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[dict[str, Any]]:
    a, b = nodes
    rows = []
    last = None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), transport=transport) as client:
        for i, messages in enumerate(prompts):
            for kind, node in (("miss", a), ("local", a), ("remote", b)):
                if node != last:  # wake it (the module docstring): one token of a prompt shorter than a block
                    warm = {"model": model, "prompt": WARM_UP, "max_tokens": 1}
                    resp = await client.post(f"{url}/v1/completions", json=warm, headers={"x-tandem-node": node})
                    resp.raise_for_status()
                last = node
                body = {
                    "model": model,
                    "messages": messages(f"Task probe-{i}-{kind}: explain what the {kind} handler does."),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                r = await one_request(client, f"{url}/v1/chat/completions", body, {"x-tandem-node": node})
                usage = r.usage or {}
                rows.append(
                    {
                        "prefix": i,
                        "kind": kind,
                        "node": node,
                        "ok": r.ok,
                        "error": r.error,
                        "ttft_ms": round(r.ttft_s * 1000, 1),
                        "prompt_tokens": usage.get("prompt_tokens"),
                        "kv_origin": (usage.get("tandem") or {}).get("kv_origin"),
                        "as_expected": came_as_expected(r, kind),
                    }
                )
    return rows


def probe_by_origin(
    url: str,
    model: str,
    nodes: tuple[str, str],
    workload: AgentWorkloadConfig,
    count_tokens: Callable[[str], int],
    *,
    n: int = 5,
    max_tokens: int = 16,
) -> dict[str, Any]:
    """Run the probe (module docstring) on ``nodes`` (A, B) behind the router at ``url``. Returns
    ``local_hit_ttft_ms``, ``remote_hit_ttft_ms``, ``miss_ttft_ms`` (medians), ``prefix_tokens``, the
    counts per kind that came from where they should, and every request."""
    nonce = uuid.uuid4().hex[:8]
    prompts = []
    for i in range(n):
        system, repo = shared_context(workload, f"probe-{nonce}-{i}", i % workload.repos, count_tokens)

        def messages(task: str, system: str = system, repo: str = repo) -> list[dict[str, str]]:
            return [{"role": "system", "content": system}, {"role": "user", "content": repo + task}]

        prompts.append(messages)
    rows = asyncio.run(_probe(url, model, nodes, prompts, max_tokens))
    first = prompts[0]("")
    return {
        **summarize(rows),
        "prefix_tokens": count_tokens(first[0]["content"]) + count_tokens(first[1]["content"]),
        "nodes": list(nodes),
        "requests": rows,
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT medians per kind over the requests that came from where their kind says, and their counts."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        ttfts = [r["ttft_ms"] for r in rows if r["kind"] == kind and r["as_expected"]]
        key = "miss_ttft_ms" if kind == "miss" else f"{kind}_hit_ttft_ms"
        out[key] = statistics.median(ttfts) if ttfts else float("nan")
        out[f"{kind}_as_expected"] = len(ttfts)
    return out
