"""Wire format: messages round-trip, and block pairs are cut into the fewest contiguous segments."""

from __future__ import annotations

import pytest

from kv_transfer import wire
from kv_transfer.wire import Segment


def test_messages_round_trip_with_their_tags() -> None:
    msgs = [wire.Pull("t", [Segment(1, 2, 3)], "tcp"), wire.LayerHeader("t", 0, [1], "float32", [3, 16, 128],
                                                                            [100], [42]),
            wire.End("t", 30), wire.Grant("t", 99, [1 << 40], [4096], [[1, 2]]), wire.Done("t", False, "bad"),
            wire.Release("t", "no room"), wire.Reject("t", "expired"), wire.Fault("stall", 2.0), wire.Ack()]
    for m in msgs:
        assert wire.decode(wire.encode(m)) == m
    assert b"kv.pull.v1" in wire.encode(msgs[0])


def test_segments_cut_where_either_side_jumps() -> None:
    assert wire.segments_of([1, 2, 3, 10, 11], [5, 6, 7, 8, 20]) == [
        Segment(1, 5, 3), Segment(10, 8, 1), Segment(11, 20, 1)]
    assert wire.segments_of([], []) == []
    assert wire.segments_of([7], [0]) == [Segment(7, 0, 1)]
    with pytest.raises(ValueError):
        wire.segments_of([1, 2], [1])
