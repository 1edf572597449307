"""The router's periodic work shares one loop: one wake-up a tick, each job at its own period."""

from __future__ import annotations

import asyncio
import logging

import pytest

from router import housekeeping as hk_module
from router.housekeeping import Housekeeping


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_jobs_run_at_their_own_periods_within_one_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(hk_module.time, "monotonic", clock)
    hk = Housekeeping(tick_s=1.0)
    ran: list[str] = []

    async def refresh() -> None:
        ran.append("refresh")

    hk.every(1.0, refresh, name="refresh")
    hk.every(3.0, lambda: ran.append("rows"), name="rows")
    for _ in range(7):
        await hk.run_due()
        clock.now += 1.0
    assert ran.count("refresh") == 7  # every tick, async jobs awaited
    assert ran.count("rows") == 3  # ticks 0, 3 and 6
    assert hk.rounds == 7


async def test_a_failing_job_is_logged_and_runs_again_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = _Clock()
    monkeypatch.setattr(hk_module.time, "monotonic", clock)
    hk = Housekeeping(tick_s=1.0)
    calls = {"bad": 0, "good": 0}

    def bad() -> None:
        calls["bad"] += 1
        raise RuntimeError("redis went away")

    def good() -> None:
        calls["good"] += 1

    hk.every(1.0, bad, name="bad")
    hk.every(1.0, good, name="good")
    with caplog.at_level(logging.ERROR, logger="tandem.router.housekeeping"):
        for _ in range(3):
            await hk.run_due()
            clock.now += 1.0
    assert calls == {"bad": 3, "good": 3}
    assert sum("housekeeping job bad failed" in r.getMessage() for r in caplog.records) == 3


async def test_the_loop_wakes_once_a_tick_and_stops() -> None:
    hk = Housekeeping(tick_s=0.01)
    seen = asyncio.Event()
    hk.every(0.01, seen.set, name="mark")
    hk.start()
    assert hk.running
    await asyncio.wait_for(seen.wait(), 5)
    await hk.stop()
    assert not hk.running


def test_a_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="period of x must be positive"):
        Housekeeping().every(0, lambda: None, name="x")
