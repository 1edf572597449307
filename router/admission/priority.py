"""Admission control: per-node slots, queues ordered by class then arrival, shedding and deadlines.

Algorithm
    Each node has ``max_concurrency`` slots. ``async with controller.slot(node, priority, deadline)``
    takes a free slot at once when no one is queued; otherwise it queues. The queue is ordered by
    (class rank, arrival): every queued ``interactive`` request is served before any ``batch`` one, and
    FIFO within a class. A released slot goes to the first queued request whose deadline has not passed.

Bound and shedding (``max_queue`` per node)
    A request arriving at a full queue: if it is ``batch`` it is refused; if it is ``interactive`` the
    *last-arrived* queued ``batch`` request is evicted to make room, and only when no batch request is
    queued is the interactive one refused. Refusals raise ``Unavailable`` (503) with
    ``retry_after = ceil(mean slot hold time × queued / max_concurrency)``, at least 1 s, from an
    exponential moving average (alpha 0.2) of how long slots are held.

Deadlines
    Each request carries an absolute deadline (``time.monotonic()`` seconds). A request still queued
    when it passes is dropped, never served: ``Unavailable(code="deadline_exceeded")``. A request whose
    deadline has already passed on arrival is dropped at once. Holding a slot past the deadline is the
    caller's business (the engine call has its own timeout).

Cancellation (client gone) removes a queued request, and a slot granted to a request that was
cancelled in the same instant is passed on, so no slot leaks.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from contracts.errors import Unavailable
from router.admission.priority_class import Priority

EWMA_ALPHA = 0.2


@dataclass(order=True)
class _Waiter:
    rank: int
    seq: int
    deadline: float = field(compare=False)
    priority: Priority = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)
    removed: bool = field(default=False, compare=False)


@dataclass
class NodeQueueStats:
    running: int
    queued_interactive: int
    queued_batch: int
    shed: int
    expired: int


class _NodeQueue:
    def __init__(self, node_id: str, max_concurrency: int, max_queue: int) -> None:
        self.node_id = node_id
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.running = 0
        self.heap: list[_Waiter] = []
        self.queued = {Priority.INTERACTIVE: 0, Priority.BATCH: 0}
        self.mean_hold_s = 1.0
        self.shed = 0
        self.expired = 0

    def push(self, w: _Waiter) -> None:
        heapq.heappush(self.heap, w)
        self.queued[w.priority] += 1

    def discard(self, w: _Waiter) -> None:
        """Lazy removal: mark, and let ``pop`` skip it."""
        if not w.removed:
            w.removed = True
            self.queued[w.priority] -= 1

    def pop(self) -> _Waiter | None:
        while self.heap:
            w = heapq.heappop(self.heap)
            if not w.removed:
                w.removed = True
                self.queued[w.priority] -= 1
                return w
        return None

    @property
    def size(self) -> int:
        return self.queued[Priority.INTERACTIVE] + self.queued[Priority.BATCH]

    def last_batch(self) -> _Waiter | None:
        batch = [w for w in self.heap if not w.removed and w.priority is Priority.BATCH]
        return max(batch, key=lambda w: w.seq, default=None)

    def retry_after(self) -> float:
        return max(1.0, math.ceil(self.mean_hold_s * (self.size + 1) / self.max_concurrency))


class AdmissionController:
    """In-process (per router) admission queues, one per node. asyncio-only; not thread-safe."""

    def __init__(self, *, max_concurrency: int = 8, max_queue: int = 64) -> None:
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError("max_concurrency must be >= 1 and max_queue >= 0")
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self._nodes: dict[str, _NodeQueue] = {}
        self._seq = itertools.count()

    def _node(self, node_id: str) -> _NodeQueue:
        q = self._nodes.get(node_id)
        if q is None:
            q = self._nodes[node_id] = _NodeQueue(node_id, self.max_concurrency, self.max_queue)
        return q

    def stats(self, node_id: str) -> NodeQueueStats:
        q = self._node(node_id)
        return NodeQueueStats(
            running=q.running,
            queued_interactive=q.queued[Priority.INTERACTIVE],
            queued_batch=q.queued[Priority.BATCH],
            shed=q.shed,
            expired=q.expired,
        )

    def snapshot(self) -> dict[str, NodeQueueStats]:
        """Stats of every node this controller has queued for (for ``/metrics``)."""
        return {node_id: self.stats(node_id) for node_id in list(self._nodes)}

    @asynccontextmanager
    async def slot(self, node_id: str, priority: Priority, deadline: float) -> AsyncIterator[None]:
        """Hold one of the node's slots for the body of the ``async with``."""
        q = self._node(node_id)
        await self._acquire(q, node_id, priority, deadline)
        started = time.monotonic()
        try:
            yield
        finally:
            held = time.monotonic() - started
            q.mean_hold_s += EWMA_ALPHA * (held - q.mean_hold_s)
            q.running -= 1
            self._grant_next(q)

    async def _acquire(self, q: _NodeQueue, node_id: str, priority: Priority, deadline: float) -> None:
        now = time.monotonic()
        if deadline <= now:
            q.expired += 1
            raise _expired(node_id)
        if q.running < q.max_concurrency and q.size == 0:
            q.running += 1
            return
        if q.size >= q.max_queue:
            victim = q.last_batch() if priority is Priority.INTERACTIVE else None
            if victim is None:
                q.shed += 1
                raise Unavailable(
                    f"node {node_id} is overloaded ({q.size} {priority} requests queued); try again",
                    retry_after=q.retry_after(),
                    code="overloaded",
                )
            q.discard(victim)
            q.shed += 1
            victim.future.set_exception(
                Unavailable(
                    f"batch request shed from node {node_id} to make room for interactive traffic",
                    retry_after=q.retry_after(),
                    code="shed",
                )
            )
        w = _Waiter(priority.rank, next(self._seq), deadline, priority, asyncio.get_running_loop().create_future())
        q.push(w)
        try:
            await asyncio.wait_for(asyncio.shield(w.future), timeout=deadline - now)
        except TimeoutError:
            q.discard(w)
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                # granted in the same instant the deadline passed: dropped all the same, pass the slot on
                q.running -= 1
                self._grant_next(q)
            q.expired += 1
            raise _expired(node_id) from None
        except asyncio.CancelledError:
            q.discard(w)
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                q.running -= 1
                self._grant_next(q)
            raise

    def _grant_next(self, q: _NodeQueue) -> None:
        now = time.monotonic()
        while q.running < q.max_concurrency:
            w = q.pop()
            if w is None:
                return
            if w.future.done():
                continue
            if w.deadline <= now:
                q.expired += 1
                w.future.set_exception(_expired(q.node_id))
                continue
            q.running += 1
            w.future.set_result(None)


def _expired(node_id: str) -> Unavailable:
    return Unavailable(
        f"request deadline passed while queued for node {node_id}; it was not served",
        retry_after=1.0,
        code="deadline_exceeded",
    )
