"""The worker's idle wait: on a step that computes nothing, ``transfer_results`` sleeps until a lease
ends or a pull finishes, instead of handing control straight back to vLLM's spinning loop."""

from __future__ import annotations

import numpy as np

from decode_nodes.puller import Puller
from kv_connector.worker import TandemWorker
from kv_transfer import wire
from kv_transfer.layout import KVLayout
from kv_transfer.metadata import TandemMetadata
from kv_transfer.settings import ConnectorSettings
from prefill_nodes.lease import LeaseState


class RecordingEvent:
    """Stands in for the worker's activity event; ``during_wait`` plays the server thread."""

    def __init__(self, during_wait=None) -> None:  # noqa: ANN001
        self.waits: list[float] = []
        self.during_wait = during_wait

    def clear(self) -> None:
        pass

    def set(self) -> None:
        pass

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        if self.during_wait is not None:
            self.during_wait()
        return True


def _worker(idle_wait_ms: float = 5.0, pull_wait_ms: float = 50.0) -> TandemWorker:
    settings = ConnectorSettings(port=9111, idle_wait_ms=idle_wait_ms, pull_wait_ms=pull_wait_ms)
    w = TandemWorker(settings, "engine-p", num_blocks=4)
    layout = KVLayout.from_arrays([np.zeros((4, 8), np.uint8)])
    w.puller = Puller(layout, w.stats, wire.Codec(b"x" * 32), threads=1)
    return w


def _step(w: TandemWorker, *, idle: bool) -> None:
    w._idle = TandemMetadata(idle=idle).idle  # what start() records from the step's metadata


def test_idle_step_waits_for_the_lease_to_end_and_returns_it() -> None:
    w = _worker()
    w.leases.add("t1", [0, 1], deadline=1e12)
    w._activity = ev = RecordingEvent(lambda: w.leases.move("t1", LeaseState.RELEASED, "decode said no"))
    _step(w, idle=True)
    sending, recving, failed = w.transfer_results({"t1"})
    assert ev.waits == [0.005]
    assert sending == {"t1"} and not recving and not failed


def _idle_step_while_pulling(w: TandemWorker) -> tuple[TandemWorker, RecordingEvent]:
    """One idle step of ``w`` while its puller reports a pull in flight; the waits it made."""
    assert w.puller is not None
    w.puller.in_flight = lambda: 1  # type: ignore[method-assign]
    w._activity = ev = RecordingEvent()
    _step(w, idle=True)
    w.transfer_results(set())
    return w, ev


def test_idle_step_during_its_own_pull_waits_up_to_pull_wait_ms() -> None:
    """A decode node's idle step waits for its pull with the longer bound (each return to vLLM's
    loop during a pull sets its worker spinning on the pull's core); a lease alone keeps the short one."""
    w, ev = _idle_step_while_pulling(_worker())
    assert ev.waits == [0.05]
    w.puller.in_flight = lambda: 0  # type: ignore[method-assign]
    w.leases.add("t1", [0], deadline=1e12)
    w.transfer_results(set())
    assert ev.waits == [0.05, 0.005]


def test_a_pull_wait_shorter_than_the_idle_wait_is_the_idle_wait() -> None:
    _, ev = _idle_step_while_pulling(_worker(idle_wait_ms=5.0, pull_wait_ms=0))
    assert ev.waits == [0.005]


def test_busy_step_never_waits() -> None:
    w = _worker()
    w.leases.add("t1", [0, 1], deadline=1e12)
    w._activity = ev = RecordingEvent()
    _step(w, idle=False)
    assert w.transfer_results(set()) == (set(), set(), set())
    assert ev.waits == []


def test_idle_step_with_nothing_in_flight_or_already_ended_does_not_wait() -> None:
    w = _worker()
    w._activity = ev = RecordingEvent()
    _step(w, idle=True)
    w.transfer_results(set())  # no lease, no pull: nothing to wait for
    w.leases.add("t2", [2], deadline=1e12)
    w.leases.move("t2", LeaseState.EXPIRED, "test")
    assert w.transfer_results({"t2"})[0] == {"t2"}  # already ended: collect it at once
    assert ev.waits == []


def test_idle_wait_can_be_turned_off() -> None:
    w = _worker(idle_wait_ms=0)
    w.leases.add("t1", [0], deadline=1e12)
    w._activity = ev = RecordingEvent()
    _step(w, idle=True)
    w.transfer_results(set())
    assert ev.waits == []


def test_a_lease_ending_on_another_thread_wakes_the_wait() -> None:
    """The real event: the server thread ends the lease while the engine thread waits. With a 60 s
    wait, returning at all within the pytest run's patience shows the wake-up works; the elapsed
    bound is generous (a missed wake-up costs the whole minute)."""
    import threading
    import time

    w = _worker(idle_wait_ms=60_000)
    w.leases.add("t1", [0], deadline=1e12)
    _step(w, idle=True)
    waiting = threading.Event()
    real_wait = w._activity.wait

    def wait_and_announce(timeout: float) -> bool:
        waiting.set()
        return real_wait(timeout)

    w._activity.wait = wait_and_announce  # type: ignore[method-assign]
    ender = threading.Thread(target=lambda: (waiting.wait(60), w.leases.move("t1", LeaseState.RELEASED)))
    ender.start()
    t0 = time.monotonic()
    sending, _, _ = w.transfer_results({"t1"})
    ender.join()
    assert sending == {"t1"}
    assert time.monotonic() - t0 < 30
