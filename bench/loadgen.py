"""A closed-loop SSE load generator: `concurrency` workers send chat requests back to back and time
every token as the client sees it (TTFT, ITL, E2E, output tokens/s)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class LevelStats:
    concurrency: int
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    output_tok_s: float
    wall_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      headers: dict[str, str]) -> RequestResult:
    start = time.perf_counter()
    last = first = None
    itl: list[float] = []
    out = prompt = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                return RequestResult(ok=False, error=f"{resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(ok=False, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    out = chunk["usage"].get("completion_tokens", out)
                    prompt = chunk["usage"].get("prompt_tokens", prompt)
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        elif last is not None:
                            itl.append(now - last)
                        last = now
    except httpx.HTTPError as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if first is None:
        return RequestResult(ok=False, error="no token received")
    return RequestResult(ok=True, ttft_s=first - start, e2e_s=end - start, itl_s=itl, output_tokens=out,
                         prompt_tokens=prompt)


async def run_level(base_url: str, model: str, prompts: Sequence[list[dict[str, str]]], concurrency: int,
                    n_requests: int, max_tokens: int, headers: dict[str, str] | None = None,
                    on_done: Callable[[], None] | None = None) -> tuple[LevelStats, list[RequestResult]]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(i)
    results: list[RequestResult] = []
    url = f"{base_url}/v1/chat/completions"

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {"model": model, "messages": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            results.append(await one_request(client, url, body, headers or {}))
            if on_done:
                on_done()

    limits = httpx.Limits(max_connections=concurrency + 4)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl_s]
    ms = 1000.0
    stats = LevelStats(
        concurrency=concurrency, requests=len(results), errors=len(results) - len(ok),
        ttft_p50_ms=percentile([r.ttft_s for r in ok], 0.5) * ms,
        ttft_p99_ms=percentile([r.ttft_s for r in ok], 0.99) * ms,
        itl_p50_ms=percentile(itl, 0.5) * ms, itl_p99_ms=percentile(itl, 0.99) * ms,
        e2e_p50_ms=percentile([r.e2e_s for r in ok], 0.5) * ms,
        e2e_p99_ms=percentile([r.e2e_s for r in ok], 0.99) * ms,
        output_tok_s=sum(r.output_tokens for r in ok) / wall if wall > 0 else 0.0, wall_s=wall,
    )
    return stats, results


def mean_or_nan(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")
