"""Block server and puller in two real processes over real sockets: every transport delivers the exact
bytes into the right blocks, and every failure (bad checksum, expired lease, unknown lease, stall past
the deadline, release) ends the lease and reports the pull as failed, never a hang."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from decode_nodes.puller import Puller, PullJob
from kv_transfer import wire
from kv_transfer.layout import KVLayout
from kv_transfer.stats import TransferStats
from tests.support.block_server_proc import BLOCKS, LAYERS, SECRET, SHAPE, Remote, transfer_params
from tests.support.block_server_proc import source as _source


@pytest.fixture(scope="module")
def remote() -> Iterator[Remote]:
    r = Remote()
    yield r
    r.close()


@pytest.fixture
def local() -> tuple[list[np.ndarray], Puller]:
    arrays = [np.zeros((BLOCKS, *SHAPE), np.float32) for _ in range(LAYERS)]
    puller = Puller(KVLayout.from_arrays(arrays), TransferStats(), wire.Codec(SECRET))
    yield arrays, puller
    puller.close()


def _pull(
    remote: Remote,
    puller: Puller,
    tid: str,
    transport: str,
    remote_ids: list[int],
    local_ids: list[int],
    timeout: float = 5.0,
    checksum: bool = True,
):  # noqa: ANN202
    ep = remote.tcp if transport in ("tcp", "ucx") else remote.ipc
    puller.submit(
        PullJob(
            tid,
            tid,
            ep,
            transport,
            wire.segments_of(remote_ids, local_ids),
            local_ids,
            time.monotonic() + timeout,
            checksum=checksum,
        )
    )
    return puller.outcomes.get(timeout=timeout + 10)


@pytest.mark.parametrize("transport", ["tcp", "ipc", "shm", "ucx"])
def test_each_transport_moves_the_exact_blocks(remote: Remote, local, transport: str) -> None:  # noqa: ANN001
    arrays, puller = local
    src = _source()
    remote_ids, local_ids = [2, 3, 4, 9, 30], [0, 1, 2, 17, 5]
    tid = f"ok-{transport}"
    remote.offer(tid, remote_ids)
    out = _pull(remote, puller, tid, transport, remote_ids, local_ids)
    assert out.ok, out.reason
    assert out.nbytes == LAYERS * len(remote_ids) * src[0][0].nbytes
    for layer in range(LAYERS):
        np.testing.assert_array_equal(arrays[layer][local_ids], src[layer][remote_ids])
        untouched = [b for b in range(BLOCKS) if b not in local_ids]
        assert not arrays[layer][untouched].any()
    assert remote.ended(tid) == "done"


@pytest.mark.parametrize("split", [True, False], ids=["split", "decode-copies-all"])
def test_shm_with_and_without_the_prefill_node_writing_half(remote: Remote, split: bool) -> None:
    arrays = [np.zeros((BLOCKS, *SHAPE), np.float32) for _ in range(LAYERS)]
    puller = Puller(KVLayout.from_arrays(arrays), TransferStats(), wire.Codec(SECRET), shm_split=split)
    try:
        src = _source()
        remote_ids, local_ids = [12, 13, 14, 20], [8, 9, 10, 30]
        tid = f"shm-split-{split}"
        remote.offer(tid, remote_ids)
        out = _pull(remote, puller, tid, "shm", remote_ids, local_ids)
        assert out.ok, out.reason
        for layer in range(LAYERS):
            np.testing.assert_array_equal(arrays[layer][local_ids], src[layer][remote_ids])
        assert remote.ended(tid) == "done"
    finally:
        puller.close()


def test_a_small_shm_pull_is_copied_by_the_decode_side_alone_a_large_one_is_split(remote: Remote, monkeypatch) -> None:  # noqa: ANN001
    """Below ``shm_split_min_bytes`` the decode side asks the prefill node to write nothing (no
    ``Pushed`` to wait for) and copies every layer itself; at or above it, the copy is split."""
    from decode_nodes import puller as puller_module

    made = []
    real = puller_module.transport_for

    def recording(name, **kw):  # noqa: ANN001, ANN003, ANN202
        made.append(real(name, **kw))
        return made[-1]

    monkeypatch.setattr(puller_module, "transport_for", recording)
    arrays = [np.zeros((BLOCKS, *SHAPE), np.float32) for _ in range(LAYERS)]
    layout = KVLayout.from_arrays(arrays)
    two_blocks = 2 * layout.block_nbytes * LAYERS
    puller = Puller(layout, TransferStats(), wire.Codec(SECRET), shm_split_min_bytes=two_blocks)
    try:
        src = _source()
        for tid, remote_ids, local_ids in (("small-shm", [15], [3]), ("large-shm", [16, 17], [4, 5])):
            remote.offer(tid, remote_ids)
            out = _pull(remote, puller, tid, "shm", remote_ids, local_ids)
            assert out.ok, out.reason
            assert remote.ended(tid) == "done"
        assert [t.split for t in made] == [False, True]
        for layer in range(LAYERS):
            np.testing.assert_array_equal(arrays[layer][[3, 4, 5]], src[layer][[15, 16, 17]])
    finally:
        puller.close()


def test_shm_push_that_cannot_write_falls_back_to_the_decode_side_copy(remote: Remote, local, monkeypatch) -> None:  # noqa: ANN001
    """The prefill node's process_vm_writev fails (here: addresses that are not mapped in this
    process, EFAULT); it says so with Pushed(ok=False) and this side copies those layers itself."""
    from kv_transfer.transports import CmaTransport

    arrays, puller = local
    real_target = CmaTransport.target

    def unmapped(self, layout):  # noqa: ANN001, ANN202
        t = real_target(self, layout)
        return wire.CmaTarget(
            t.pid, [4096 * (i + 1) for i in range(LAYERS)], t.block_nbytes, t.num_blocks, t.push_layers
        )

    monkeypatch.setattr(CmaTransport, "target", unmapped)
    src = _source()
    remote_ids, local_ids = [21, 22], [11, 12]
    remote.offer("shm-fallback", remote_ids)
    out = _pull(remote, puller, "shm-fallback", "shm", remote_ids, local_ids)
    assert out.ok, out.reason
    for layer in range(LAYERS):
        np.testing.assert_array_equal(arrays[layer][local_ids], src[layer][remote_ids])
    assert remote.ended("shm-fallback") == "done"


def test_the_router_can_ask_how_a_transfer_went(remote: Remote, local) -> None:  # noqa: ANN001
    """``lease_report`` (what the router asks after a streamed answer) gives the prefill node's view:
    state, bytes, start at the Pull, end at the Done; an unknown lease gives None."""
    import asyncio

    from kv_transfer.control import lease_report

    _, puller = local
    remote.offer("asked", [15, 16])
    before = time.time()
    out = _pull(remote, puller, "asked", "tcp", [15, 16], [15, 16])
    assert out.ok and remote.ended("asked") == "done"
    params = transfer_params("asked", remote.tcp)
    report = asyncio.run(lease_report(params))
    assert report is not None and report["ok"] and report["state"] == "done" and report["transport"] == "tcp"
    assert report["bytes"] == out.nbytes == 2 * LAYERS * _source()[0][0].nbytes
    assert before <= report["start"] <= report["end"] <= time.time() and report["seconds"] >= 0
    assert asyncio.run(lease_report({**params, "transfer_id": "never-leased"})) is None


def test_a_corrupted_frame_fails_the_pull_and_the_lease(remote: Remote, local) -> None:  # noqa: ANN001
    _, puller = local
    remote.offer("bad", [1, 2])
    assert remote.fault("corrupt") == wire.Ack(True)
    out = _pull(remote, puller, "bad", "tcp", [1, 2], [3, 4])
    assert not out.ok and "checksum" in out.reason and out.local_block_ids == [3, 4]
    assert remote.ended("bad") == "failed"


def test_an_expired_lease_is_refused(remote: Remote, local) -> None:  # noqa: ANN001
    _, puller = local
    assert remote.fault("expire") == wire.Ack(True)
    remote.offer("late", [5])
    assert remote.ended("late") == "expired"
    out = _pull(remote, puller, "late", "tcp", [5], [6])
    assert not out.ok and "refused" in out.reason


def test_a_stalled_transfer_fails_at_its_deadline_and_the_lease_still_ends(remote: Remote, local) -> None:  # noqa: ANN001
    _, puller = local
    remote.offer("stall", [7, 8], ttl=3.0)
    assert remote.fault("stall", 2.5) == wire.Ack(True)
    t0 = time.monotonic()
    out = _pull(remote, puller, "stall", "tcp", [7, 8], [7, 8], timeout=1.0)
    assert not out.ok and "timed out" in out.reason and time.monotonic() - t0 < 5
    assert remote.ended("stall") in ("failed", "expired")


def test_release_frees_a_lease_nobody_pulls_even_before_it_arrives(remote: Remote, local) -> None:  # noqa: ANN001
    _, puller = local
    remote.offer("rel", [10])
    puller.release(remote.tcp, "rel", "decode node has no room")
    assert remote.ended("rel") == "released"
    puller.release(remote.tcp, "early", "client gone")  # the Release overtakes the lease
    remote.offer("early", [11])
    assert remote.ended("early") == "released"


def test_a_dead_prefill_node_fails_the_pull_at_its_deadline(local) -> None:  # noqa: ANN001
    _, puller = local
    with zmq.Context.instance().socket(zmq.REP) as s:
        port = s.bind_to_random_port("tcp://127.0.0.1")
    t0 = time.monotonic()
    puller.submit(
        PullJob("dead", "dead", f"tcp://127.0.0.1:{port}", "tcp", [wire.Segment(0, 0, 1)], [0], time.monotonic() + 1.0)
    )
    out = puller.outcomes.get(timeout=10)
    assert not out.ok and "timed out" in out.reason and time.monotonic() - t0 < 5


# -- shm: the copy starts while the Grant is in flight ----------------------------------------------------
def test_a_second_shm_pull_copies_before_its_grant_and_delivers_the_exact_blocks(remote: Remote, local) -> None:  # noqa: ANN001
    arrays, puller = local
    src = _source()
    remote.offer("early-1", [1, 2])
    assert _pull(remote, puller, "early-1", "shm", [1, 2], [1, 2]).ok
    assert puller.early_copies == 0  # nothing was known of the peer before its first Grant
    remote.offer("early-2", [5, 6, 7])
    out = _pull(remote, puller, "early-2", "shm", [5, 6, 7], [20, 21, 22])
    assert out.ok, out.reason
    assert puller.early_copies == 1
    for layer in range(LAYERS):
        np.testing.assert_array_equal(arrays[layer][[20, 21, 22]], src[layer][[5, 6, 7]])
    assert remote.ended("early-2") == "done"


def test_an_early_copy_is_not_kept_when_the_grant_names_another_process(remote: Remote, local) -> None:  # noqa: ANN001
    """The known peer is stale (here: this very process, with decoy bytes at its addresses, as if the
    prefill node had restarted): the Grant from the socket's proven peer differs, so the blocks are
    read again from that peer, and what lands is the prefill node's data, not the decoy's."""
    import os

    from kv_transfer.transports import KnownPeer, process_start_time

    arrays, puller = local
    decoy = [np.full((BLOCKS, *SHAPE), 7.0, np.float32) for _ in range(LAYERS)]
    start = process_start_time(os.getpid())
    assert start is not None
    puller._peers[remote.ipc] = KnownPeer(os.getpid(), start, tuple(a.ctypes.data for a in decoy))
    remote.offer("stale-peer", [3, 4])
    out = _pull(remote, puller, "stale-peer", "shm", [3, 4], [10, 11])
    assert out.ok, out.reason
    assert puller.early_copies == 0
    src = _source()
    for layer in range(LAYERS):
        np.testing.assert_array_equal(arrays[layer][[10, 11]], src[layer][[3, 4]])


def test_an_early_copy_for_an_ended_lease_fails_the_pull(remote: Remote, local) -> None:  # noqa: ANN001
    _, puller = local
    remote.offer("known-first", [8])
    assert _pull(remote, puller, "known-first", "shm", [8], [8]).ok
    out = _pull(remote, puller, "never-leased-shm", "shm", [9], [9], timeout=3.0)
    assert not out.ok and out.local_block_ids == [9]  # its blocks go to recompute


def test_a_reused_pid_is_not_taken_for_the_known_peer() -> None:
    import os
    import subprocess

    from kv_transfer.transports import KnownPeer, process_start_time

    me = process_start_time(os.getpid())
    assert me is not None and KnownPeer(os.getpid(), me, ()).alive()
    assert not KnownPeer(os.getpid(), me + 1, ()).alive()  # same pid, another process's start
    child = subprocess.Popen(["true"])
    child.wait()
    assert process_start_time(child.pid) is None


def test_a_restarted_prefill_node_is_proven_again_and_never_read_as_its_predecessor(local) -> None:  # noqa: ANN001
    """Between pulls the puller keeps its socket and the prefill process the last Grant proved. A
    prefill node killed and started again on the same endpoints is a new process with a new cache:
    the next pull copies nothing early from the dead one's addresses, reconnects, delivers the new
    process's blocks and learns it; the pull after that copies early again."""
    arrays, puller = local
    first = Remote()
    try:
        for i, block in enumerate((1, 2)):
            first.offer(f"restart-{i}", [block])
            assert _pull(first, puller, f"restart-{i}", "shm", [block], [block]).ok
        assert puller.early_copies == 1
        known = puller.known_peer(first.ipc)
        assert known is not None and known.pid == first.proc.pid
    finally:
        first.proc.kill()  # a crash: nothing is said to the puller
        first.proc.join(10)
    second = Remote(seed=8, endpoints=(first.tcp, first.ipc))
    try:
        new_src = _source(8)
        second.offer("restart-2", [5])
        out = _pull(second, puller, "restart-2", "shm", [5], [6])
        assert out.ok, out.reason
        assert puller.early_copies == 1  # the dead process's addresses were not read
        known = puller.known_peer(second.ipc)
        assert known is not None and known.pid == second.proc.pid
        second.offer("restart-3", [7])
        assert _pull(second, puller, "restart-3", "shm", [7], [9]).ok
        assert puller.early_copies == 2
        for layer in range(LAYERS):
            np.testing.assert_array_equal(arrays[layer][[6, 9]], new_src[layer][[5, 7]])
        assert second.ended("restart-3") == "done"
    finally:
        second.close()


def test_a_proven_peer_is_held_by_a_pidfd_and_dead_once_its_process_exits(monkeypatch) -> None:  # noqa: ANN001
    """``KnownPeer.prove`` reads /proc once for a new process and keeps a pidfd on it; proving the same
    living process again returns the same peer (its handle kept) without reading /proc; once the
    process exits the peer is dead at once (even unreaped), and proving its pid again yields nothing."""
    import os
    import subprocess

    from kv_transfer import transports
    from kv_transfer.transports import KnownPeer

    child = subprocess.Popen(["sleep", "60"])
    try:
        peer = KnownPeer.prove(child.pid, [4096, 8192], None)
        assert peer is not None and peer.handle is not None and peer.alive()
        assert peer.start_time == transports.process_start_time(child.pid)

        def no_proc_reads(pid: int) -> int | None:
            raise AssertionError("read /proc for a process its pidfd already vouches for")

        monkeypatch.setattr(transports, "process_start_time", no_proc_reads)
        assert KnownPeer.prove(child.pid, (4096, 8192), peer) is peer
        moved = KnownPeer.prove(child.pid, (4096, 12288), peer)  # same process, other addresses
        assert moved is not None and moved != peer and moved.handle is peer.handle
        monkeypatch.undo()
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has exited, and is not reaped
        assert transports.ProcessHandle.open(child.pid) is not None  # a zombie still has a pidfd...
        assert not peer.alive()  # ...which says it exited
        assert KnownPeer.prove(child.pid, (4096, 8192), peer) is None  # gone: a Grant naming it fails
    finally:
        child.kill()
        child.wait()
    assert not peer.alive()
