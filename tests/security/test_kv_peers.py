"""Node-to-node trust on the KV path (issue 13, item 4), against a real block server in its own process
over real tcp and ipc sockets:

- a frame without a valid MAC under the cluster secret (unsigned, protocol 1, another secret) is
  answered at once with a Reject, counted, and changes nothing: the lease it names stays held;
- a puller holding another secret fails fast, not at its deadline;
- an ``shm`` Pull naming a pid other than the one its Unix socket proves is refused, as is ``shm`` over
  tcp; the decode side reads only from the pid its own socket proves;
- faults are refused unless the server was started with them, and a server with them says so loudly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq

from contracts.secret import SECRET_ENV
from decode_nodes.puller import Puller, PullJob
from kv_transfer import control, wire
from kv_transfer.layout import KVLayout
from kv_transfer.stats import TransferStats
from kv_transfer.transports import CmaTransport, TransferFailed
from prefill_nodes.block_server import BlockServer
from prefill_nodes.lease import LeaseTable
from tests.support.block_server_proc import BLOCKS, LAYERS, SECRET, SHAPE, Remote, source, transfer_params

OTHER = wire.Codec(b"not-the-cluster-secret-0123456789abcdef")


@pytest.fixture(scope="module")
def remote() -> Iterator[Remote]:
    r = Remote(faults=False)  # as in production: faults off
    yield r
    r.close()


@pytest.fixture
def local() -> Iterator[tuple[list[np.ndarray], KVLayout]]:
    arrays = [np.zeros((BLOCKS, *SHAPE), np.float32) for _ in range(LAYERS)]
    yield arrays, KVLayout.from_arrays(arrays)


@pytest.fixture
def victim() -> Iterator[int]:
    """Another process of this user (what a forged shm Pull would have the prefill node write into)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc.pid
    proc.communicate(b"")


def _pull(
    remote: Remote, codec: wire.Codec, layout: KVLayout, tid: str, transport: str, ids: list[int], timeout: float = 5.0
):  # noqa: ANN202
    puller = Puller(layout, TransferStats(), codec)
    try:
        ep = remote.tcp if transport == "tcp" else remote.ipc
        puller.submit(PullJob(tid, tid, ep, transport, wire.segments_of(ids, ids), ids, time.monotonic() + timeout))
        return puller.outcomes.get(timeout=timeout + 10)
    finally:
        puller.close()


def _assert_delivered(arrays: list[np.ndarray], ids: list[int]) -> None:
    src = source()
    for layer in range(LAYERS):
        np.testing.assert_array_equal(arrays[layer][ids], src[layer][ids])


def _unauthenticated(remote: Remote, data: bytes, endpoint: str | None = None) -> wire.Reject:
    """Send a frame that carries no valid MAC; the answer comes at once, signed, and is a Reject."""
    answer = remote.codec.decode(remote.call(data, endpoint))
    assert isinstance(answer, wire.Reject) and answer.reason.startswith("unauthenticated"), answer
    return answer


# -- MACs ----------------------------------------------------------------------------------------------------
def test_an_unauthenticated_pull_is_refused_and_the_lease_stays_held(remote: Remote, local) -> None:  # noqa: ANN001
    arrays, layout = local
    remote.offer("sec-plain", [1, 2])
    pull = wire.Pull("sec-plain", wire.segments_of([1, 2], [1, 2]), "tcp")
    bad_before = remote.refusals()[0]
    _unauthenticated(remote, msgspec.msgpack.encode(pull))  # a protocol-1 peer: no envelope at all
    _unauthenticated(remote, OTHER.encode(pull))  # signed, with another secret
    forged = bytearray(remote.codec.encode(pull))
    forged[-1] ^= 1  # signed with the right secret, then altered
    _unauthenticated(remote, bytes(forged))
    assert remote.refusals()[0] == bad_before + 3
    assert remote.state("sec-plain") == "held"
    out = _pull(remote, remote.codec, layout, "sec-plain", "tcp", [1, 2])  # the real decode node still can
    assert out.ok, out.reason
    _assert_delivered(arrays, [1, 2])
    assert remote.ended("sec-plain") == "done"


def test_a_puller_with_another_secret_fails_fast_and_gets_nothing(remote: Remote, local) -> None:  # noqa: ANN001
    arrays, layout = local
    remote.offer("sec-other", [3, 4])
    t0 = time.monotonic()
    out = _pull(remote, OTHER, layout, "sec-other", "tcp", [3, 4], timeout=30.0)
    assert not out.ok and "authentication" in out.reason
    assert time.monotonic() - t0 < 10, "waited out its deadline instead of being refused"
    assert not any(a.any() for a in arrays)
    assert remote.state("sec-other") == "held"


def test_unauthenticated_release_query_and_fault_change_nothing(remote: Remote, local) -> None:  # noqa: ANN001
    arrays, layout = local
    remote.offer("sec-ctl", [5, 6])
    for msg in (
        wire.Release("sec-ctl", "forged"),
        wire.Query("sec-ctl"),
        wire.Fault("corrupt"),
        wire.Done("sec-ctl", False, "forged"),
    ):
        _unauthenticated(remote, OTHER.encode(msg))
        _unauthenticated(remote, msgspec.msgpack.encode(msg))
    assert remote.state("sec-ctl") == "held"
    out = _pull(remote, remote.codec, layout, "sec-ctl", "tcp", [5, 6])
    assert out.ok, out.reason  # no corrupt fault was armed
    _assert_delivered(arrays, [5, 6])


def test_the_routers_calls_are_signed_and_refused_under_another_secret(
    remote: Remote,
    local,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, layout = local
    remote.offer("sec-router", [7])
    params = transfer_params("sec-router", remote.tcp)
    assert asyncio.run(control.lease_report(params)) is not None  # the cluster secret: answered
    monkeypatch.setenv(SECRET_ENV, "another-router-secret-0123456789abcdef")
    control._codec.cache_clear()
    try:
        bad_before = remote.refusals()[0]
        assert asyncio.run(control.release_lease(params, "forged")) is False
        assert asyncio.run(control.lease_report(params)) is None
        assert remote.refusals()[0] == bad_before + 2
    finally:
        control._codec.cache_clear()
    assert remote.state("sec-router") == "held"


# -- shm: a proven local peer, its own pid, never over tcp ---------------------------------------------------
def _shm_pull(tid: str, layout: KVLayout, pid: int) -> wire.Pull:
    target = CmaTransport(split=True).target(layout)
    return wire.Pull(
        tid,
        wire.segments_of([8, 9], [8, 9]),
        "shm",
        False,
        cma=wire.CmaTarget(pid, target.layer_addresses, target.block_nbytes, target.num_blocks, target.push_layers),
    )


def test_an_shm_pull_naming_another_pid_is_refused(remote: Remote, local, victim: int) -> None:  # noqa: ANN001
    arrays, layout = local
    remote.offer("sec-pid", [8, 9])
    peer_before = remote.refusals()[1]
    answer = remote.codec.decode(remote.call(remote.codec.encode(_shm_pull("sec-pid", layout, victim)), remote.ipc))
    assert isinstance(answer, wire.Reject) and f"names pid {victim}" in answer.reason, answer
    assert f"belongs to pid {os.getpid()}" in answer.reason
    assert remote.refusals()[1] == peer_before + 1
    assert remote.state("sec-pid") == "held"  # nothing was sent or written
    out = _pull(remote, remote.codec, layout, "sec-pid", "shm", [8, 9])  # naming itself, it is served
    assert out.ok, out.reason
    _assert_delivered(arrays, [8, 9])


def test_shm_is_never_served_over_tcp(remote: Remote, local) -> None:  # noqa: ANN001
    _, layout = local
    remote.offer("sec-tcp", [10])
    pull = _shm_pull("sec-tcp", layout, os.getpid())  # even naming the true pid: tcp proves nothing
    answer = remote.codec.decode(remote.call(remote.codec.encode(pull), remote.tcp))
    assert isinstance(answer, wire.Reject) and "refused over tcp" in answer.reason, answer
    out = _pull(remote, remote.codec, layout, "sec-tcp-2", "tcp", [11])
    assert not out.ok  # (no lease: just proves the server kept serving)
    assert remote.state("sec-tcp") == "held"


def test_the_decode_side_reads_only_from_the_pid_its_socket_proves(local, victim: int) -> None:  # noqa: ANN001
    """A Grant naming a pid other than the server socket's owner is not read from."""
    arrays, layout = local
    codec = wire.Codec(SECRET)
    path = f"ipc://{tempfile.mkdtemp(prefix='tandem-sec-')}/fake.sock"
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.bind(path)

    def answer() -> None:  # a "prefill node" in this process that names another process's memory
        ident, frame = server.recv_multipart()
        pull = codec.decode(frame)
        grant = wire.Grant(
            pull.transfer_id, victim, [layout.address(i) for i in range(LAYERS)], [layout.block_nbytes] * LAYERS, []
        )
        server.send_multipart([ident, codec.encode(grant)])

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        with ctx.socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(path)
            transport = CmaTransport(split=False)
            pull = transport.pull("fake", wire.segments_of([1], [1]), False, layout)
            sock.send(codec.encode(pull))
            with pytest.raises(TransferFailed, match=f"Grant names pid {victim}"):
                transport.receive(sock, pull, layout, time.monotonic() + 5, codec=codec)
    finally:
        t.join(5)
        server.close(0)


# -- faults --------------------------------------------------------------------------------------------------
def test_faults_are_refused_unless_enabled(remote: Remote, local) -> None:  # noqa: ANN001
    arrays, layout = local
    for kind in ("corrupt", "expire", "hold", "stall"):
        assert remote.fault(kind, 1.0) == wire.Ack(False)
    remote.offer("sec-faults", [12, 13])
    out = _pull(remote, remote.codec, layout, "sec-faults", "tcp", [12, 13])
    assert out.ok, out.reason  # nothing was armed: not corrupted, not held, not expired
    _assert_delivered(arrays, [12, 13])


@pytest.mark.parametrize("faults", [True, False], ids=["on", "off"])
def test_a_server_with_faults_on_warns_at_start(local, faults: bool, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    _, layout = local
    ep = f"ipc://{tempfile.mkdtemp(prefix='tandem-sec-')}/kv.sock"
    server = BlockServer(layout, LeaseTable("t"), [ep], TransferStats(), wire.Codec(SECRET), faults=faults)
    with caplog.at_level(logging.WARNING, logger="tandem.kv.server"):
        server.start()
    server.close()
    loud = [r for r in caplog.records if r.levelno == logging.WARNING and "FAULT INJECTION IS ON" in r.getMessage()]
    assert len(loud) == (1 if faults else 0)
