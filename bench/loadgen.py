"""SSE load generators that time every token as the client sees it (TTFT, ITL, E2E, output tokens/s).

``run_level``: closed loop, ``concurrency`` workers send chat requests back to back.
``run_sessions``: multi-turn sessions that arrive open-loop at fixed times (whatever the system's
state); within a session each turn is sent a think time after the previous answer ended, as an agent
that reads an answer and runs a tool before calling again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
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
    usage: dict[str, Any] | None = None
    """The final SSE chunk's ``usage`` as the server sent it (hit-rate breakdown included)."""


class StreamRefused(Exception):
    """A streamed request answered with a status other than 200 (the message: the status and the start
    of the body)."""


async def data_events(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> AsyncIterator[Any]:
    """The decoded JSON of each ``data:`` line of a streamed POST, ``[DONE]`` left out; a status other
    than 200 raises ``StreamRefused``. Iterate it under ``contextlib.aclosing``, so that leaving the
    loop early closes the response then, not when the generator is collected."""
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise StreamRefused(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            yield json.loads(line[6:])


@dataclass
class TokenClock:
    """When a stream's text came, as the client sees it: from ``start``, the first chunk (TTFT) and the
    gaps between chunks (ITL)."""

    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    itl: list[float] = field(default_factory=list)

    def tick(self) -> None:
        """A chunk with text has come now."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.itl.append(now - self.last)
        self.last = now


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


def streamed_chat(model: str, messages: Any, max_tokens: int) -> dict[str, Any]:
    """A benchmark's chat request: greedy, exactly ``max_tokens`` out (``ignore_eos``), streamed with usage."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> RequestResult:
    clock = TokenClock()
    out = prompt = 0
    usage: dict[str, Any] | None = None
    try:
        async with contextlib.aclosing(data_events(client, url, body, headers)) as chunks:
            async for chunk in chunks:
                if "error" in chunk:
                    return RequestResult(ok=False, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    out = chunk["usage"].get("completion_tokens", out)
                    prompt = chunk["usage"].get("prompt_tokens", prompt)
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        clock.tick()
    except StreamRefused as exc:
        return RequestResult(ok=False, error=str(exc))
    except httpx.HTTPError as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if clock.first is None:
        return RequestResult(ok=False, error="no token received")
    return RequestResult(
        ok=True,
        ttft_s=clock.first - clock.start,
        e2e_s=end - clock.start,
        itl_s=clock.itl,
        output_tokens=out,
        prompt_tokens=prompt,
        usage=usage,
    )


async def run_level(
    base_url: str,
    model: str,
    prompts: Sequence[list[dict[str, str]]],
    concurrency: int,
    n_requests: int,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    on_done: Callable[[], None] | None = None,
) -> tuple[LevelStats, list[RequestResult]]:
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
            body = streamed_chat(model, prompts[i % len(prompts)], max_tokens)
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
        concurrency=concurrency,
        requests=len(results),
        errors=len(results) - len(ok),
        ttft_p50_ms=percentile([r.ttft_s for r in ok], 0.5) * ms,
        ttft_p99_ms=percentile([r.ttft_s for r in ok], 0.99) * ms,
        itl_p50_ms=percentile(itl, 0.5) * ms,
        itl_p99_ms=percentile(itl, 0.99) * ms,
        e2e_p50_ms=percentile([r.e2e_s for r in ok], 0.5) * ms,
        e2e_p99_ms=percentile([r.e2e_s for r in ok], 0.99) * ms,
        output_tok_s=sum(r.output_tokens for r in ok) / wall if wall > 0 else 0.0,
        wall_s=wall,
    )
    return stats, results


def mean_or_nan(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


@dataclass(frozen=True)
class SessionScript:
    """One multi-turn session, scripted in advance: its turns' messages do not depend on the answers."""

    session_id: str
    start_s: float
    """Arrival of the first turn, seconds after the run starts (open loop)."""
    turns: Sequence[list[dict[str, str]]]
    """Each turn's whole message list (the history so far plus the new messages)."""
    think_s: Sequence[float]
    """Pause after turn i's answer before turn i+1 is sent (len(turns) - 1 values)."""


@dataclass
class SentRequest:
    session_id: str
    turn: int
    sent_s: float
    """When it was sent, seconds after the run started."""
    late_s: float
    """How much later than planned (session arrival) a session's first turn went out (0 for others)."""
    result: RequestResult


async def run_sessions(
    base_url: str,
    model: str,
    sessions: Sequence[SessionScript],
    max_tokens: int,
    headers: Mapping[str, str] | None = None,
    on_done: Callable[[SentRequest], None] | None = None,
    max_sessions: int | None = None,
) -> list[SentRequest]:
    """Replay ``sessions`` against ``base_url`` (POST /v1/chat/completions, SSE). Each request carries
    ``x-session-id``. With ``max_sessions``, at most that many sessions run at once (as an agent pool
    of that size): a session that arrives while all are busy starts when one ends, and its lateness
    counts that wait. Returns every request in the order it was sent."""
    slots = asyncio.Semaphore(max_sessions or len(sessions) or 1)
    url = f"{base_url}/v1/chat/completions"
    sent: list[SentRequest] = []
    t0 = time.perf_counter()

    async def session(client: httpx.AsyncClient, s: SessionScript) -> None:
        await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - t0)))
        async with slots:
            await turns(client, s)

    async def turns(client: httpx.AsyncClient, s: SessionScript) -> None:
        late = max(0.0, time.perf_counter() - t0 - s.start_s)
        for i, messages in enumerate(s.turns):
            body = streamed_chat(model, messages, max_tokens)
            entry = SentRequest(
                s.session_id,
                i,
                time.perf_counter() - t0,
                late if i == 0 else 0.0,
                RequestResult(ok=False, error="not finished"),
            )
            sent.append(entry)
            entry.result = await one_request(client, url, body, {**(headers or {}), "x-session-id": s.session_id})
            if on_done:
                on_done(entry)
            if i < len(s.think_s):
                await asyncio.sleep(s.think_s[i])

    limits = httpx.Limits(max_connections=len(sessions) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        await asyncio.gather(*(session(client, s) for s in sessions))
    return sent
