"""Layer-wise pulls against a real block server in another process, over real sockets: the decode side
asks before the prefill has written anything (by position), gets each layer as the prefill reports it
and not before, waits through a long prefill on heartbeats, and every way it can end half-way (the
prefill aborted, a corrupted layer, the decode node gone) ends the lease and fails the pull cleanly."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from decode_nodes.puller import Puller, PullJob, PullOutcome
from kv_transfer import wire
from kv_transfer.layout import KVLayout
from kv_transfer.stats import TransferStats
from tests.support.block_server_proc import BLOCKS, LAYERS, SECRET, SHAPE, Remote
from tests.support.block_server_proc import source as _source
from tests.support.helpers import wait_for

TRANSPORTS = ["tcp", "ipc", "shm"]
REMOTE_IDS = [4, 5, 6, 12, 13]
"""The lease's blocks, prompt positions 0..4; the decode node knows only the positions."""
LOCAL_IDS = [0, 1, 2, 3, 9]


@pytest.fixture(scope="module")
def remote() -> Iterator[Remote]:
    r = Remote()
    yield r
    r.close()


@pytest.fixture
def local() -> Iterator[tuple[list[np.ndarray], Puller]]:
    arrays = [np.zeros((BLOCKS, *SHAPE), np.float32) for _ in range(LAYERS)]
    puller = Puller(KVLayout.from_arrays(arrays), TransferStats(), wire.Codec(SECRET))
    yield arrays, puller
    puller.close()


def _submit(remote: Remote, puller: Puller, tid: str, transport: str, stall_s: float = 3.0) -> None:
    ep = remote.tcp if transport == "tcp" else remote.ipc
    positions = list(range(len(LOCAL_IDS)))
    puller.submit(
        PullJob(
            tid,
            tid,
            ep,
            transport,
            wire.segments_of(positions, LOCAL_IDS),
            LOCAL_IDS,
            time.monotonic() + stall_s,
            checksum=True,
            layerwise=True,
        )
    )


def _outcome(puller: Puller, timeout: float = 20.0) -> PullOutcome:
    return puller.outcomes.get(timeout=timeout)


def _has_layer(arrays: list[np.ndarray], layer: int) -> bool:
    return bool(np.array_equal(arrays[layer][LOCAL_IDS], _source()[layer][REMOTE_IDS]))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_layer_arrives_as_the_prefill_writes_it_and_not_before(remote: Remote, local, transport: str) -> None:  # noqa: ANN001
    arrays, puller = local
    tid = f"lw-{transport}"
    remote.open_fill(tid)
    _submit(remote, puller, tid, transport)  # asked before the prefill has written anything
    assert wait_for(lambda: remote.state(tid) == "sending", timeout_s=10)
    for layer in range(LAYERS - 1):
        remote.fill(tid, layer + 1, REMOTE_IDS)
        assert wait_for(lambda layer=layer: _has_layer(arrays, layer), timeout_s=10), f"layer {layer} never came"
        assert not arrays[layer + 1].any(), f"layer {layer + 1} came before the prefill wrote it"
        assert puller.outcomes.empty()
    remote.fill(tid, LAYERS, REMOTE_IDS, done=True)
    out = _outcome(puller)
    assert out.ok, out.reason
    assert out.nbytes == LAYERS * len(LOCAL_IDS) * _source()[0][0].nbytes
    for layer in range(LAYERS):
        assert _has_layer(arrays, layer)
        untouched = [b for b in range(BLOCKS) if b not in LOCAL_IDS]
        assert not arrays[layer][untouched].any()
    assert remote.ended(tid) == "done"


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_prefill_longer_than_the_stall_timeout_is_waited_for_on_heartbeats(
    remote: Remote,
    local,  # noqa: ANN001
    transport: str,
) -> None:
    arrays, puller = local
    tid = f"lw-slow-{transport}"
    remote.open_fill(tid)
    _submit(remote, puller, tid, transport, stall_s=1.0)
    assert wait_for(lambda: remote.state(tid) == "sending", timeout_s=10)
    t0 = time.monotonic()
    # the prefill "computes" for 2.5 stall timeouts; the server's 0.2 s heartbeats keep the pull alive
    assert not wait_for(lambda: not puller.outcomes.empty(), timeout_s=2.5)
    assert time.monotonic() - t0 >= 2.5
    remote.fill(tid, LAYERS, REMOTE_IDS, done=True)
    out = _outcome(puller)
    assert out.ok, out.reason
    assert all(_has_layer(arrays, layer) for layer in range(LAYERS))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prefill_aborted_half_way_fails_the_pull_and_ends_the_lease(remote: Remote, local, transport: str) -> None:  # noqa: ANN001
    _, puller = local
    tid = f"lw-abort-{transport}"
    remote.open_fill(tid)
    _submit(remote, puller, tid, transport)
    assert wait_for(lambda: remote.state(tid) == "sending", timeout_s=10)
    remote.fill(tid, 1, REMOTE_IDS)
    remote.abort_fill(tid, "client gone")
    out = _outcome(puller)
    assert not out.ok and "prefill ended" in out.reason and out.local_block_ids == LOCAL_IDS
    assert remote.ended(tid) == "failed"


def test_an_aborted_prefill_nobody_pulled_yet_is_released(remote: Remote, local) -> None:  # noqa: ANN001
    _, puller = local
    remote.open_fill("lw-abort-early")
    remote.abort_fill("lw-abort-early", "engine error")
    assert remote.ended("lw-abort-early") == "released"
    _submit(remote, puller, "lw-abort-early", "tcp")
    out = _outcome(puller)
    assert not out.ok and "refused" in out.reason


def test_a_corrupted_layer_fails_the_pull_and_the_lease(remote: Remote, local) -> None:  # noqa: ANN001
    _, puller = local
    tid = "lw-corrupt"
    remote.open_fill(tid)
    _submit(remote, puller, tid, "tcp")
    assert wait_for(lambda: remote.state(tid) == "sending", timeout_s=10)
    assert remote.fault("corrupt") == wire.Ack(True)
    remote.fill(tid, 2, REMOTE_IDS)
    out = _outcome(puller)
    assert not out.ok and "checksum" in out.reason
    remote.fill(tid, LAYERS, REMOTE_IDS, done=True)  # the prefill goes on; its lease is over already
    assert remote.ended(tid) == "failed"


def test_a_decode_node_gone_half_way_strands_nothing(remote: Remote) -> None:
    """The decode side asks, takes one layer, and vanishes (its socket closed, never a Done): once the
    prefill ends, the lease's deadline runs and it expires."""
    tid = "lw-gone"
    codec = wire.Codec(SECRET)
    remote.open_fill(tid, lease_s=1.0)
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(remote.tcp)
        sock.send(codec.encode(wire.Pull(tid, wire.segments_of([0, 1], [0, 1]), "tcp", layerwise=True)))
        assert wait_for(lambda: remote.state(tid) == "sending", timeout_s=10)
        remote.fill(tid, 1, REMOTE_IDS)
        assert sock.poll(5000)
        assert isinstance(codec.decode(sock.recv()), wire.Filling)
    assert remote.state(tid) == "sending"  # no deadline while the prefill computes
    remote.fill(tid, LAYERS, REMOTE_IDS, done=True)
    assert remote.ended(tid, timeout=15) == "expired"


def test_positions_outside_the_lease_are_refused(remote: Remote, local) -> None:  # noqa: ANN001
    _, puller = local
    tid = "lw-outside"
    remote.open_fill(tid)
    _submit(remote, puller, tid, "tcp")
    assert wait_for(lambda: remote.state(tid) == "sending", timeout_s=10)
    remote.fill(tid, 1, REMOTE_IDS[:2])  # the lease holds two blocks; five positions were asked
    out = _outcome(puller)
    assert not out.ok and "outside the lease" in out.reason
    assert remote.ended(tid) == "failed"


def test_a_pull_waiting_for_a_lease_that_never_opened_is_refused_when_it_is_released(remote: Remote) -> None:
    """A router gives up on a layer-wise pair whose prefill never opened its lease (the prefill leg was
    refused): its Release answers the decode node's waiting pull at once, not at PARK_S, and a lease
    that opens late under that id is released, not left to its deadline."""
    tid = "lw-never"
    codec = wire.Codec(SECRET)
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(remote.tcp)
        # One socket keeps the order: the Pull is parked before the Release comes.
        sock.send(codec.encode(wire.Pull(tid, wire.segments_of([0, 1], [0, 1]), "tcp", layerwise=True)))
        sock.send(codec.encode(wire.Release(tid, "prefill leg refused")))
        answers = []
        for _ in range(2):
            assert sock.poll(2000), "the waiting pull was not answered at once"
            answers.append(codec.decode(sock.recv()))
    reject = next(a for a in answers if isinstance(a, wire.Reject))
    assert reject.transfer_id == tid and "prefill leg refused" in reject.reason
    assert wire.Ack() in answers
    remote.open_fill(tid)
    assert remote.ended(tid) == "released"


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_split_pull_opens_its_gate_layer_by_layer_and_once_cancelled_writes_nothing_more(
    remote: Remote,
    local,  # noqa: ANN001
    transport: str,
) -> None:
    """A split prefill's pull (``kv_connector.layer_gate``): the engine's wait for layer 0 returns once the
    prefill has written layer 0, not before; a pull given up (the engine's forward stopped waiting)
    writes no later layer into blocks its engine now recomputes, and its lease ends."""
    from kv_connector.layer_gate import LayerGate

    arrays, puller = local
    gate = LayerGate(stall_s=30)
    tid = f"lw-split-{transport}"
    remote.open_fill(tid)
    watch = gate.open(tid, LOCAL_IDS)
    positions = list(range(len(LOCAL_IDS)))
    ep = remote.tcp if transport == "tcp" else remote.ipc
    segments = wire.segments_of(positions, LOCAL_IDS)
    job = PullJob(tid, tid, ep, transport, segments, LOCAL_IDS, time.monotonic() + 5, layerwise=True, watch=watch)
    puller.submit(job)
    assert wait_for(lambda: remote.state(tid) == "sending", timeout_s=10)
    assert watch.written == 0
    remote.fill(tid, 1, REMOTE_IDS)
    assert gate.wait(0) == []  # returns: layer 0 is in place
    assert _has_layer(arrays, 0) and not arrays[1].any()
    puller.cancel(tid)
    remote.fill(tid, LAYERS, REMOTE_IDS, done=True)  # everything else, after the pull was given up
    out = _outcome(puller)
    assert not out.ok and "cancelled" in out.reason
    assert not any(arrays[layer].any() for layer in range(1, LAYERS))
    assert [e.request_id for e in gate.wait(1)] == [tid]  # ended, not ok: handed back once
    assert wait_for(lambda: remote.ended(tid) is not None, timeout_s=10)
