"""The lease state machine: every path ends in a terminal state exactly once, and nothing else moves."""

from __future__ import annotations

import time

import pytest

from prefill_nodes.lease import LeaseError, LeaseState, LeaseTable


def _table() -> LeaseTable:
    t = LeaseTable("prefill-0")
    t.add("t1", [3, 4, 5], time.time() + 30)
    return t


@pytest.mark.parametrize(
    ("path", "outcome"),
    [
        ([LeaseState.SENDING, LeaseState.AWAIT_ACK, LeaseState.DONE], LeaseState.DONE),
        ([LeaseState.SENDING, LeaseState.AWAIT_ACK, LeaseState.FAILED], LeaseState.FAILED),
        ([LeaseState.RELEASED], LeaseState.RELEASED),
        (
            [LeaseState.SENDING, LeaseState.HELD, LeaseState.SENDING, LeaseState.AWAIT_ACK, LeaseState.RELEASED],
            LeaseState.RELEASED,
        ),
    ],
)
def test_each_path_ends_once_and_frees_its_blocks(path: list[LeaseState], outcome: LeaseState) -> None:
    t = _table()
    assert t.leased_blocks() == 3
    for state in path:
        t.move("t1", state)
    ended = t.take_ended()
    assert [(lease.transfer_id, lease.state) for lease in ended] == [("t1", outcome)]
    assert len(t) == 0 and t.leased_blocks() == 0 and t.take_ended() == []
    assert t.outcomes[outcome.value] == 1


def test_no_transition_out_of_a_terminal_state_or_skipping_one() -> None:
    t = _table()
    with pytest.raises(LeaseError):
        t.move("t1", LeaseState.DONE)  # HELD → DONE skips the transfer
    t.move("t1", LeaseState.RELEASED)
    with pytest.raises(LeaseError):
        t.move("t1", LeaseState.SENDING)  # ended: a late Pull is refused
    assert t.ended_state("t1") is LeaseState.RELEASED
    t.add("t2", [1], time.time() + 1)
    with pytest.raises(LeaseError):
        t.add("t2", [1], time.time() + 1)


@pytest.mark.parametrize("state", [LeaseState.HELD, LeaseState.SENDING, LeaseState.AWAIT_ACK])
def test_deadline_expires_a_lease_in_any_live_state(state: LeaseState) -> None:
    t = LeaseTable("p")
    t.add("t1", [1, 2], time.time() + 5)
    if state is not LeaseState.HELD:
        t.move("t1", LeaseState.SENDING)
    if state is LeaseState.AWAIT_ACK:
        t.move("t1", LeaseState.AWAIT_ACK)
    assert t.expire(now=time.time()) == []  # not yet
    gone = t.expire(now=time.time() + 6)
    assert [lease.state for lease in gone] == [LeaseState.EXPIRED] and state.value in gone[0].reason
    assert t.take_ended()[0].state is LeaseState.EXPIRED and len(t) == 0


def test_next_deadline_and_wait_for() -> None:
    t = LeaseTable("p")
    assert t.next_deadline() is None and t.wait_for("x", 0.01) is None
    t.add("a", [1], 100.0)
    t.add("b", [2], 50.0)
    assert t.next_deadline() == 50.0
    assert t.wait_for("a", 0.01) is not None
