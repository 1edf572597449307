"""Per-node admission queues: class-then-arrival order, batch shed first, deadlines, no leaked slots."""

from __future__ import annotations

import asyncio
import time

import pytest

from contracts.errors import Unavailable
from router.admission import AdmissionController, Priority
from tests.router.admission.support import wait_until

INTER, B = Priority.INTERACTIVE, Priority.BATCH


def far() -> float:
    return time.monotonic() + 30


class Holder:
    """Holds a node's slot until ``release`` is called."""

    def __init__(self, ctl: AdmissionController, node: str) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.task = asyncio.create_task(self._hold(ctl, node))

    async def _hold(self, ctl: AdmissionController, node: str) -> None:
        async with ctl.slot(node, INTER, far()):
            self.entered.set()
            await self.release.wait()


async def _served(ctl, node, priority, name, order, deadline=None):
    async with ctl.slot(node, priority, deadline or far()):
        order.append(name)


async def _queue(ctl, node, specs, order):
    tasks = []
    for name, prio in specs:
        tasks.append(asyncio.create_task(_served(ctl, node, prio, name, order)))
        n = len(tasks)
        await wait_until(lambda n=n: _queued(ctl, node) == n)
    return tasks


def _queued(ctl, node) -> int:
    s = ctl.stats(node)
    return s.queued_interactive + s.queued_batch


async def test_queue_serves_interactive_first_then_arrival_order():
    ctl = AdmissionController(max_concurrency=1, max_queue=10)
    holder = Holder(ctl, "n1")
    await holder.entered.wait()
    order: list[str] = []
    tasks = await _queue(ctl, "n1", [("b1", B), ("i1", INTER), ("b2", B), ("i2", INTER)], order)
    holder.release.set()
    await asyncio.gather(holder.task, *tasks)
    assert order == ["i1", "i2", "b1", "b2"]
    assert ctl.stats("n1").running == 0


async def test_nodes_have_separate_slots():
    ctl = AdmissionController(max_concurrency=1, max_queue=10)
    holder = Holder(ctl, "n1")
    await holder.entered.wait()
    order: list[str] = []
    await asyncio.wait_for(_served(ctl, "n2", B, "other-node", order), timeout=5)
    assert order == ["other-node"]
    holder.release.set()
    await holder.task


async def test_full_queue_sheds_batch_before_interactive():
    ctl = AdmissionController(max_concurrency=1, max_queue=2)
    holder = Holder(ctl, "n1")
    await holder.entered.wait()
    order: list[str] = []
    b1, b2 = await _queue(ctl, "n1", [("b1", B), ("b2", B)], order)

    # interactive at a full queue: the last-arrived batch request is shed to make room
    i1 = asyncio.create_task(_served(ctl, "n1", INTER, "i1", order))
    with pytest.raises(Unavailable) as shed:
        await b2
    assert shed.value.code == "shed" and shed.value.status_code == 503 and shed.value.retry_after >= 1

    # batch at a full queue (b1, i1): refused
    with pytest.raises(Unavailable) as refused:
        await _served(ctl, "n1", B, "b3", order)
    assert refused.value.code == "overloaded"

    # interactive again: b1 goes
    i2 = asyncio.create_task(_served(ctl, "n1", INTER, "i2", order))
    with pytest.raises(Unavailable):
        await b1

    # queue now holds only interactive requests: a third interactive is refused
    with pytest.raises(Unavailable, match="overloaded"):
        await _served(ctl, "n1", INTER, "i3", order)

    holder.release.set()
    await asyncio.gather(holder.task, i1, i2)
    assert order == ["i1", "i2"]  # no shed or refused request was served
    stats = ctl.stats("n1")
    assert (stats.running, stats.queued_batch, stats.queued_interactive, stats.shed) == (0, 0, 0, 4)


async def test_request_whose_deadline_passes_in_the_queue_is_dropped_not_served():
    ctl = AdmissionController(max_concurrency=1, max_queue=10)
    holder = Holder(ctl, "n1")
    await holder.entered.wait()
    order: list[str] = []
    with pytest.raises(Unavailable) as err:
        await _served(ctl, "n1", INTER, "late", order, deadline=time.monotonic() + 0.05)
    assert err.value.code == "deadline_exceeded"
    assert "not served" in err.value.message
    holder.release.set()
    await holder.task
    assert order == []
    assert ctl.stats("n1").expired == 1 and ctl.stats("n1").running == 0


async def test_expired_deadline_is_dropped_even_with_a_free_slot():
    ctl = AdmissionController(max_concurrency=4, max_queue=10)
    order: list[str] = []
    with pytest.raises(Unavailable, match="deadline"):
        await _served(ctl, "n1", INTER, "stale", order, deadline=time.monotonic() - 0.001)
    assert order == []


async def test_queued_request_past_its_deadline_is_skipped_when_a_slot_frees():
    ctl = AdmissionController(max_concurrency=1, max_queue=10)
    holder = Holder(ctl, "n1")
    await holder.entered.wait()
    order: list[str] = []
    deadline = time.monotonic() + 0.05
    doomed = asyncio.create_task(_served(ctl, "n1", INTER, "doomed", order, deadline=deadline))
    (nxt,) = await _queue(ctl, "n1", [("next", B)], order)
    await wait_until(lambda: time.monotonic() > deadline)
    holder.release.set()
    with pytest.raises(Unavailable, match="deadline"):
        await doomed
    await asyncio.gather(holder.task, nxt)
    assert order == ["next"]


async def test_cancelled_waiter_leaves_no_slot_behind():
    ctl = AdmissionController(max_concurrency=1, max_queue=10)
    holder = Holder(ctl, "n1")
    await holder.entered.wait()
    order: list[str] = []
    gone, stays = await _queue(ctl, "n1", [("gone", INTER), ("stays", B)], order)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert _queued(ctl, "n1") == 1
    holder.release.set()
    await asyncio.gather(holder.task, stays)
    assert order == ["stays"]
    assert ctl.stats("n1").running == 0


async def test_body_errors_release_the_slot():
    ctl = AdmissionController(max_concurrency=1, max_queue=1)
    with pytest.raises(RuntimeError):
        async with ctl.slot("n1", INTER, far()):
            raise RuntimeError("engine failed")
    async with ctl.slot("n1", INTER, far()):
        assert ctl.stats("n1").running == 1
    assert ctl.stats("n1").running == 0
