"""The replay loop: when each planned request is sent, and its result.

Modes (``ReplaySettings.mode``):

- ``open``: every request at ``arrival_s / speed`` after the start, whatever the answers: the recorded
  offered load, as a fleet sees it.
- ``closed``: a session's first turn at its ``arrival_s / speed``; each later turn after its parent's
  answer has ended, plus the recorded ``gap_s / speed`` (tool or think time). When the trace records
  no gap (Mooncake), the turn keeps the recorded spacing after its parent instead, but never leaves
  before the parent's answer ends: at ``max(parent end, parent sent + (arrival - parent arrival) /
  speed)``. A turn whose parent failed or was cancelled is still sent, after it. Requests without a
  session (or whose parent is not in the replayed part) are open loop.

Every request is an asyncio task that waits for its time (and, closed loop, for its parent's
``asyncio.Event``), so nothing is polled and open loop never waits on answers. Times in the results
are seconds from the replay's start (``time.monotonic`` based).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from replay.client import Outcome, send
from replay.plan import PlannedRequest


class Mode(enum.StrEnum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True)
class ReplaySettings:
    """Everything one replay run needs (one object per process)."""

    url: str
    """Base URL of the cluster's router (or any OpenAI-compatible server)."""
    model: str
    """Model name to send."""
    mode: Mode = Mode.OPEN
    """open: by timestamps; closed: per session, after each answer plus the recorded gap."""
    speed: float = 1.0
    """Time compression: 2.0 replays an hour in 30 minutes (arrivals and gaps divided by it)."""
    api_key: str | None = None
    """Bearer key, when the router has auth on."""
    session_prefix: str | None = None
    """When set, each request names its session ``<prefix><session_id>`` in ``x-session-id``."""
    ignore_eos: bool = True
    """Ask for exactly ``max_tokens`` tokens (vLLM's ``ignore_eos``)."""
    timeout_s: float = 600.0
    """Per-request read timeout."""


@dataclass(frozen=True)
class Result:
    planned: PlannedRequest
    scheduled_s: float
    outcome: Outcome
    t0: float
    """Monotonic time of the replay's start."""


async def run(
    planned: list[PlannedRequest],
    settings: ReplaySettings,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Send ``planned`` as ``settings`` say; the results in plan order. ``on_result`` is called with each
    result as it ends (progress, or a test waiting for one)."""
    if settings.speed <= 0:
        raise ValueError(f"speed must be positive, got {settings.speed}")
    url = settings.url.rstrip("/") + "/v1/completions"
    base_headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    done = {p.index: asyncio.Event() for p in planned}
    outcomes: dict[int, Outcome] = {}
    results: list[Result | None] = [None] * len(planned)
    position = {p.index: i for i, p in enumerate(planned)}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(settings.timeout_s, connect=30.0)
    t0 = 0.0  # set once the client is ready, before any request is scheduled

    async def one(p: PlannedRequest, client: httpx.AsyncClient) -> None:
        at = t0 + p.arrival_s / settings.speed
        parent = p.parent_index if p.parent_index in done else None
        if settings.mode is Mode.CLOSED and parent is not None:
            await done[parent].wait()
            po = outcomes[parent]
            if p.gap_s is not None:
                at = po.end + p.gap_s / settings.speed
            else:
                pp = planned[position[parent]]
                at = max(po.end, po.sent + (p.arrival_s - pp.arrival_s) / settings.speed)
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        body = {
            "model": settings.model,
            "prompt": p.prompt,
            "max_tokens": p.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if settings.ignore_eos:
            body["ignore_eos"] = True
        headers = dict(base_headers)
        if settings.session_prefix is not None and p.session_id is not None:
            headers["x-session-id"] = f"{settings.session_prefix}{p.session_id}"
        cancel = p.cancel_after_s / settings.speed if p.cancel_after_s is not None else None
        out = Outcome(error="replay ended before this request's answer")
        try:
            out = await send(client, url, body, headers, cancel_after_s=cancel)
        finally:  # a later turn waits on this, whatever happened
            outcomes[p.index] = out
            done[p.index].set()
        result = results[position[p.index]] = Result(p, at - t0, out, t0)
        if on_result is not None:
            on_result(result)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            for p in planned:
                tg.create_task(one(p, client))
    return [r for r in results if r is not None]
