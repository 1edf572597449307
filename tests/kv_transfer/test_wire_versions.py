"""The wire protocol's version is checked at the first frame: a peer of another protocol gets a Reject
that names both versions at once, as does an authenticated frame this version cannot decode, so neither
side waits out a deadline; a decode node that meets another version fails its pull at once, refused.
Against a real block server in its own process (``block_server_proc``)."""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Iterator

import msgspec
import pytest

from contracts.errors import VersionMismatch
from kv_transfer import wire
from kv_transfer.transports import TransferFailed, verify_answer
from tests.support.block_server_proc import SECRET, Remote


def _frame(marker: bytes, body: bytes, secret: bytes = SECRET) -> bytes:
    """A frame in the envelope layout, signed under ``marker`` (another protocol's, or ours)."""
    stamp = struct.pack(">Q", int(time.time() * 1e6))
    mac = hmac.new(secret, marker + stamp + body, hashlib.sha256).digest()
    return marker + stamp + mac + body


@pytest.fixture(scope="module")
def remote() -> Iterator[Remote]:
    r = Remote(faults=False)
    yield r
    r.close()


def test_a_frame_of_another_protocol_is_a_version_mismatch_naming_both() -> None:
    frame = _frame(b"TKV3", msgspec.msgpack.encode(wire.Query("t")))
    with pytest.raises(VersionMismatch) as err:
        wire.Codec(SECRET).decode(frame)
    assert err.value.message.startswith(f"KV wire protocol version 3 is not ours ({wire.PROTOCOL})")
    assert wire.MAGIC == b"TKV%d" % wire.PROTOCOL


def test_a_block_server_rejects_another_protocol_at_once_and_keeps_the_lease(remote: Remote) -> None:
    remote.offer("v-other", [1, 2])
    pull = wire.Pull("v-other", wire.segments_of([1, 2], [1, 2]), "tcp")
    answer = remote.codec.decode(remote.call(_frame(b"TKV3", msgspec.msgpack.encode(pull))))
    assert isinstance(answer, wire.Reject) and answer.reason.startswith(wire.VERSION_REJECT)
    assert f"version 3 is not ours ({wire.PROTOCOL})" in answer.reason
    assert remote.state("v-other") == "held"  # acted on nothing


def test_an_authenticated_frame_this_version_cannot_decode_is_rejected_at_once(remote: Remote) -> None:
    for body in (msgspec.msgpack.encode({"type": "kv.pull.v9", "x": 1}), b"\xc1\xc1"):
        answer = remote.codec.decode(remote.call(_frame(wire.MAGIC, body)))
        assert isinstance(answer, wire.Reject) and answer.reason.startswith(wire.UNDECODABLE_REJECT), answer
    assert isinstance(remote.fault("stall"), wire.Ack)  # and the server goes on serving


def test_a_decode_node_meeting_another_protocol_fails_its_pull_refused_and_says_why() -> None:
    with pytest.raises(TransferFailed) as err:
        verify_answer(wire.Codec(SECRET), _frame(b"TKV3", msgspec.msgpack.encode(wire.End("t", 1))))
    assert err.value.refused and f"KV wire protocol version 3 is not ours ({wire.PROTOCOL})" in err.value.reason
