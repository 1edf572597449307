"""The ``ucx`` transport between two real processes: UcxSender in a child process behind a small ROUTER
loop that stands in for the block server (Pull + UcxTarget in, UcxPosted out, Done → forget), and
UcxReceiver here. The exact bytes land in the right blocks; a corrupted segment, a refusal and a dead
prefill node fail the pull (the dead one at its deadline, never a hang); a decode node that dies
mid-pull leaves the prefill node serving the next one. Needs ucxx (``pip install ucxx-cu12``); runs
without a GPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

pytest.importorskip("ucxx", reason="the ucx transport needs ucxx-cu12")

from kv_transfer import wire  # noqa: E402
from kv_transfer.layout import KVLayout  # noqa: E402
from kv_transfer.transports import TransferFailed  # noqa: E402
from kv_transfer.ucx import UcxReceiver  # noqa: E402
from tests.support.block_server_proc import SECRET  # noqa: E402

LAYERS, BLOCKS, SHAPE = 3, 32, (3, 16, 128)  # 24 KiB blocks: above UCX's rendezvous threshold
CODEC = wire.Codec(SECRET)


def _source() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal((BLOCKS, *SHAPE), dtype=np.float32) for _ in range(LAYERS)]


def _serve(endpoint: str, conn) -> None:  # noqa: ANN001 - runs in the child process
    """The UCX half of prefill_nodes/block_server.py alone (no leases), so the sender's own failure paths
    can be driven."""
    from kv_transfer.ucx import UcxSender, UcxSendFailed

    sender = UcxSender(KVLayout.from_arrays(_source()))
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    conn.send("ready")
    corrupt = False
    while True:
        ident, *frames = sock.recv_multipart()
        msg = CODEC.decode(frames[0])
        if isinstance(msg, wire.Pull):
            if msg.transfer_id.startswith("refuse"):
                sock.send_multipart([ident, CODEC.encode(wire.Reject(msg.transfer_id, "unknown lease"))])
                continue
            target = msg.ucx
            try:
                posted = sender.send(msg, target, corrupt=corrupt)
            except UcxSendFailed as exc:
                sock.send_multipart([ident, CODEC.encode(wire.Reject(msg.transfer_id, str(exc)))])
                continue
            corrupt = False
            sock.send_multipart([ident, CODEC.encode(posted)])
        elif isinstance(msg, wire.Done):
            sender.forget(msg.transfer_id)
            sock.send_multipart([ident, CODEC.encode(wire.Ack())])
        elif isinstance(msg, wire.Fault):
            corrupt = msg.kind == "corrupt"
            sock.send_multipart([ident, CODEC.encode(wire.Ack())])
        elif isinstance(msg, wire.Release):  # used here as "how many transfers are still tracked?"
            sock.send_multipart([ident, CODEC.encode(wire.Reject("inflight", str(sender.inflight)))])
        elif isinstance(msg, wire.Ack):
            sender.close()
            sock.send_multipart([ident, CODEC.encode(wire.Ack())])
            return


class Prefill:
    def __init__(self) -> None:
        with zmq.Context.instance().socket(zmq.REP) as s:  # a free port, picked by the kernel
            port = s.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(self.endpoint, child), daemon=True)
        self.proc.start()
        assert self.conn.poll(60) and self.conn.recv() == "ready"

    def call(self, msg: wire.Message) -> wire.Message:
        with zmq.Context.instance().socket(zmq.DEALER) as s:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.endpoint)
            s.send(CODEC.encode(msg))
            assert s.poll(10000), "the prefill process did not answer"
            return CODEC.decode(s.recv())

    def inflight(self) -> int:
        return int(self.call(wire.Release("?", "count")).reason)

    def close(self) -> None:
        if self.proc.is_alive():
            self.call(wire.Ack())
            self.proc.join(10)


@pytest.fixture(scope="module")
def prefill() -> Iterator[Prefill]:
    p = Prefill()
    yield p
    p.close()


@pytest.fixture(scope="module")
def receiver() -> UcxReceiver:
    return UcxReceiver()


@pytest.fixture
def cache() -> tuple[list[np.ndarray], KVLayout]:
    arrays = [np.zeros((BLOCKS, *SHAPE), np.float32) for _ in range(LAYERS)]
    return arrays, KVLayout.from_arrays(arrays)


def _pull(
    endpoint: str,
    receiver: UcxReceiver,
    layout: KVLayout,
    tid: str,
    remote_ids: list[int],
    local_ids: list[int],
    timeout: float = 5.0,
) -> int:
    """What decode_nodes/puller.py does for a ``ucx`` pull (Done included), on a fresh socket."""
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        pull = wire.Pull(tid, wire.segments_of(remote_ids, local_ids), "ucx", ucx=receiver.target(layout))
        sock.send(CODEC.encode(pull))
        try:
            n = receiver.receive(sock, pull, layout, time.monotonic() + timeout, codec=CODEC)
        except TransferFailed as exc:
            if not exc.refused:
                sock.send(CODEC.encode(wire.Done(tid, False, exc.reason)))
            raise
        sock.send(CODEC.encode(wire.Done(tid, True)))
        assert sock.poll(5000)  # the Ack: the prefill side has forgotten the transfer
        return n


def _check(arrays: list[np.ndarray], remote_ids: list[int], local_ids: list[int]) -> None:
    src = _source()
    for layer in range(LAYERS):
        np.testing.assert_array_equal(arrays[layer][local_ids], src[layer][remote_ids])
        untouched = [b for b in range(BLOCKS) if b not in local_ids]
        assert not arrays[layer][untouched].any()


def test_the_exact_blocks_land_in_the_right_places(prefill: Prefill, receiver: UcxReceiver, cache) -> None:  # noqa: ANN001
    arrays, layout = cache
    remote_ids, local_ids = [2, 3, 4, 9, 30], [0, 1, 2, 17, 5]
    n = _pull(prefill.endpoint, receiver, layout, "ok-1", remote_ids, local_ids)
    assert n == LAYERS * len(remote_ids) * arrays[0][0].nbytes
    _check(arrays, remote_ids, local_ids)
    # Again on the same worker and endpoint (next tag), other blocks, then nothing is left in flight.
    for a in arrays:
        a[:] = 0
    _pull(prefill.endpoint, receiver, layout, "ok-2", [31, 0], [3, 4])
    _check(arrays, [31, 0], [3, 4])
    assert prefill.inflight() == 0


def test_threads_pull_concurrently_each_on_its_own_worker(prefill: Prefill, receiver: UcxReceiver, cache) -> None:  # noqa: ANN001
    arrays, layout = cache
    jobs = {f"thread-{k}": ([4 * k + j for j in range(4)], [16 + 4 * k + j for j in range(4)]) for k in range(4)}
    errors: list[BaseException] = []

    def run(tid: str) -> None:
        try:
            _pull(prefill.endpoint, receiver, layout, tid, *jobs[tid])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(tid,)) for tid in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    _check(arrays, sum((r for r, _ in jobs.values()), []), sum((loc for _, loc in jobs.values()), []))


def test_a_corrupted_segment_fails_the_pull(prefill: Prefill, receiver: UcxReceiver, cache) -> None:  # noqa: ANN001
    _, layout = cache
    assert prefill.call(wire.Fault("corrupt")) == wire.Ack()
    with pytest.raises(TransferFailed, match="bad checksum in layer 0 segment 0"):
        _pull(prefill.endpoint, receiver, layout, "bad", [1, 2], [3, 4])


def test_a_refusal_fails_the_pull_at_once(prefill: Prefill, receiver: UcxReceiver, cache) -> None:  # noqa: ANN001
    _, layout = cache
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="refused") as info:
        _pull(prefill.endpoint, receiver, layout, "refuse-me", [1], [1], timeout=10)
    assert info.value.refused and time.monotonic() - t0 < 2


def test_a_block_size_mismatch_is_refused(prefill: Prefill, receiver: UcxReceiver) -> None:
    arrays = [np.zeros((BLOCKS, 3, 16, 64), np.float32) for _ in range(LAYERS)]
    with pytest.raises(TransferFailed, match="layout mismatch"):
        _pull(prefill.endpoint, receiver, KVLayout.from_arrays(arrays), "small", [1], [1])


def _die_mid_pull(endpoint: str) -> None:  # noqa: D401 - runs in a child process: a decode node that dies
    arrays = [np.zeros((BLOCKS, *SHAPE), np.float32) for _ in range(LAYERS)]
    layout = KVLayout.from_arrays(arrays)
    receiver = UcxReceiver()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    pull = wire.Pull(
        "orphan", wire.segments_of(list(range(BLOCKS)), list(range(BLOCKS))), "ucx", ucx=receiver.target(layout)
    )
    sock.send(CODEC.encode(pull))
    sock.poll(5000)  # the prefill side has posted its sends; they never get a receiver
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_decode_node_dying_mid_pull_leaves_the_prefill_node_serving(
    prefill: Prefill, receiver: UcxReceiver, cache
) -> None:  # noqa: ANN001
    arrays, layout = cache
    child = mp.get_context("spawn").Process(target=_die_mid_pull, args=(prefill.endpoint,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    prefill.call(wire.Done("orphan", False, "decode node gone"))  # what lease expiry does: forget it
    _pull(prefill.endpoint, receiver, layout, "after-orphan", [5, 6], [7, 8])
    _check(arrays, [5, 6], [7, 8])
    assert prefill.inflight() == 0


def test_a_dead_prefill_node_fails_the_pull_at_its_deadline(receiver: UcxReceiver, cache) -> None:  # noqa: ANN001
    arrays, layout = cache
    dead = Prefill()
    os.kill(dead.proc.pid, signal.SIGKILL)
    dead.proc.join(10)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="timed out"):
        _pull(dead.endpoint, receiver, layout, "dead", [1, 2], [1, 2], timeout=1.0)
    assert 0.9 < time.monotonic() - t0 < 3
    assert not any(a.any() for a in arrays)


def test_a_prefill_node_dying_mid_transfer_fails_the_pull_at_its_deadline(receiver: UcxReceiver, cache) -> None:  # noqa: ANN001
    """The prefill process is killed after posting a large transfer (the sends are in flight)."""
    _, layout = cache
    dying = Prefill()
    pull = wire.Pull(
        "cut", wire.segments_of(list(range(BLOCKS)), list(range(BLOCKS))), "ucx", ucx=receiver.target(layout)
    )
    t0 = time.monotonic()
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(dying.endpoint)
        sock.send(CODEC.encode(pull))
        assert sock.poll(5000)  # UcxPosted is on its way: kill the sender now, the receive is left mid-way
        os.kill(dying.proc.pid, signal.SIGKILL)
        with pytest.raises(TransferFailed, match="timed out|ucx"):
            receiver.receive(sock, pull, layout, time.monotonic() + 1.5, codec=CODEC)
    assert time.monotonic() - t0 < 5
    dying.proc.join(10)
