"""Wire format: messages round-trip in their signed envelope, anything not signed under the cluster
secret (another secret, an altered byte, a protocol-1 frame, a stale timestamp) is refused before it is
parsed, and block pairs are cut into the fewest contiguous segments."""

from __future__ import annotations

import msgspec
import pytest

from contracts.errors import PeerUnauthenticated, UpstreamError
from kv_transfer import wire
from kv_transfer.wire import Segment

CODEC = wire.Codec(b"k" * 32)
MSGS = [
    wire.Pull("t", [Segment(1, 2, 3)], "tcp"),
    wire.LayerHeader("t", 0, [1], "float32", [3, 16, 128], [100], [42]),
    wire.End("t", 30),
    wire.Grant("t", 99, [1 << 40], [4096], [[1, 2]]),
    wire.Done("t", False, "bad"),
    wire.Release("t", "no room"),
    wire.Reject("t", "expired"),
    wire.Fault("stall", 2.0),
    wire.Ack(),
]


def test_messages_round_trip_with_their_tags() -> None:
    for m in MSGS:
        assert CODEC.decode(CODEC.encode(m)) == m
        assert CODEC.decode(memoryview(CODEC.encode(m))) == m
    frame = CODEC.encode(MSGS[0])
    assert frame.startswith(wire.MAGIC) and b"kv.pull.v1" in frame


def test_a_frame_signed_with_another_secret_is_refused() -> None:
    other = wire.Codec(b"o" * 32)
    for m in MSGS:
        with pytest.raises(PeerUnauthenticated, match="bad MAC"):
            CODEC.decode(other.encode(m))


def test_any_altered_byte_is_refused() -> None:
    frame = CODEC.encode(wire.Release("lease-1", "client gone"))
    for i in range(len(wire.MAGIC), len(frame)):  # timestamp, MAC and body alike
        bad = bytearray(frame)
        bad[i] ^= 0x01
        with pytest.raises(PeerUnauthenticated):
            CODEC.decode(bytes(bad))


def test_unsigned_and_protocol_1_frames_are_refused() -> None:
    v1 = msgspec.msgpack.encode(wire.Release("lease-1", "x"))  # what a protocol-1 peer sends
    for data in (v1, b"", wire.MAGIC, wire.MAGIC + b"\0" * 40):
        with pytest.raises(PeerUnauthenticated):
            CODEC.decode(data)


def test_a_stale_or_future_frame_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import time as real_time

    now = real_time.time()
    for skew in (-wire.MAX_SKEW_S - 5, wire.MAX_SKEW_S + 5):
        monkeypatch.setattr(wire.time, "time", lambda skew=skew: now + skew)
        frame = CODEC.encode(wire.Ack())
        monkeypatch.setattr(wire.time, "time", lambda: now)
        with pytest.raises(PeerUnauthenticated, match="timestamp"):
            CODEC.decode(frame)


def test_a_signed_frame_this_version_cannot_read_is_an_upstream_error() -> None:
    class Future(msgspec.Struct, tag="kv.future.v9"):
        x: int

    body = msgspec.msgpack.encode(Future(1))
    stamp = wire._TS.pack(int(wire.time.time() * 1e6))
    frame = wire.MAGIC + stamp + CODEC._mac(stamp, body) + body
    with pytest.raises(UpstreamError):
        CODEC.decode(frame)


def test_an_empty_secret_is_refused() -> None:
    with pytest.raises(ValueError):
        wire.Codec(b"")


def test_segments_cut_where_either_side_jumps() -> None:
    assert wire.segments_of([1, 2, 3, 10, 11], [5, 6, 7, 8, 20]) == [
        Segment(1, 5, 3),
        Segment(10, 8, 1),
        Segment(11, 20, 1),
    ]
    assert wire.segments_of([], []) == []
    assert wire.segments_of([7], [0]) == [Segment(7, 0, 1)]
    with pytest.raises(ValueError):
        wire.segments_of([1, 2], [1])
