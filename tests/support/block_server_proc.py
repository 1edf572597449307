"""A real block server in a child process (spawn), driven over a pipe: what the transport tests and the
security tests pull from. The child holds seeded random blocks (``source``); the test offers leases,
reads their terminal states and the server's refusal counters, and arms faults over the wire."""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time

import numpy as np
import zmq

from kv_transfer import wire

LAYERS, BLOCKS, SHAPE = 3, 32, (3, 16, 128)
SECRET = b"test-cluster-secret-0123456789abcdef"
"""The cluster secret of these tests (the conftest puts it in the environment too, for control.py)."""


def source(seed: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BLOCKS, *SHAPE), dtype=np.float32) for _ in range(LAYERS)]


def _serve(conn, endpoints: list[str], secret: bytes, faults: bool, seed: int) -> None:  # noqa: ANN001 - in the child
    from kv_transfer.layout import KVLayout
    from kv_transfer.stats import TransferStats
    from prefill_nodes.block_server import BlockServer
    from prefill_nodes.lease import LeaseTable

    arrays = source(seed)
    leases = LeaseTable("child")
    stats = TransferStats()
    server = BlockServer(
        KVLayout.from_arrays(arrays), leases, endpoints, stats, wire.Codec(secret), faults=faults, keepalive_s=0.2
    )
    server.start()
    conn.send("ready")
    ended: list[tuple[str, str]] = []
    while True:
        cmd = conn.recv()
        if cmd[0] == "offer":
            server.offer(*cmd[1:])
        elif cmd[0] == "open_fill":
            server.open_fill(*cmd[1:])
        elif cmd[0] == "fill":
            server.fill(cmd[1], cmd[2], cmd[3], done=cmd[4])
        elif cmd[0] == "abort_fill":
            server.abort_fill(*cmd[1:])
        elif cmd[0] == "ended":
            ended += [(lease.transfer_id, lease.state.value) for lease in leases.take_ended()]
            conn.send(ended)
        elif cmd[0] == "state":
            lease = leases.get(cmd[1])
            conn.send(lease.state.value if lease else None)
        elif cmd[0] == "refusals":
            with stats.lock:
                conn.send((stats.unauthenticated, stats.peer_refused))
        elif cmd[0] == "pid":
            conn.send(mp.current_process().pid)
        elif cmd[0] == "stop":
            server.close()
            return


class Remote:
    def __init__(
        self, *, secret: bytes = SECRET, faults: bool = True, seed: int = 7, endpoints: tuple[str, str] | None = None
    ) -> None:
        """``seed``: of the child's blocks (``source(seed)``). ``endpoints``: (tcp, ipc) to bind, e.g. a
        closed server's, as a restarted prefill node binds its predecessor's; else fresh ones."""
        if endpoints is None:
            d = tempfile.mkdtemp(prefix="tandem-kv-test-")
            with zmq.Context.instance().socket(zmq.REP) as s:  # a free port, picked by the kernel
                port = s.bind_to_random_port("tcp://127.0.0.1")
            endpoints = (f"tcp://127.0.0.1:{port}", f"ipc://{d}/kv.sock")
        self.tcp, self.ipc = endpoints
        self.codec = wire.Codec(secret)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, [self.tcp, self.ipc], secret, faults, seed), daemon=True)
        self.proc.start()
        assert self.conn.poll(30) and self.conn.recv() == "ready"

    def offer(self, tid: str, ids: list[int], ttl: float = 30.0) -> None:
        self.conn.send(("offer", tid, ids, time.time() + ttl))

    def open_fill(self, tid: str, lease_s: float = 30.0) -> None:
        """A layer-wise lease, as a prefill node opens it when its prefill starts."""
        self.conn.send(("open_fill", tid, lease_s))

    def fill(self, tid: str, layers: int, ids: list[int] | None = None, *, done: bool = False) -> None:
        """The prefill has written ``layers`` layers into the lease's blocks ``ids`` (the child's source
        blocks hold their data from the start: what this changes is what the server may send)."""
        self.conn.send(("fill", tid, layers, ids, done))

    def abort_fill(self, tid: str, reason: str) -> None:
        self.conn.send(("abort_fill", tid, reason))

    def ended(self, tid: str, timeout: float = 10.0) -> str:
        """The lease's terminal state, waiting for it (the server acts asynchronously)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.conn.send(("ended",))
            states = dict(self.conn.recv())
            if tid in states:
                return states[tid]
            time.sleep(0.05)  # polling another process's table; no event crosses the pipe for this
        raise AssertionError(f"lease {tid} never ended")

    def state(self, tid: str) -> str | None:
        """The live lease's state now (None: no live lease)."""
        self.conn.send(("state", tid))
        return self.conn.recv()

    def refusals(self) -> tuple[int, int]:
        """(frames refused for their MAC, pulls refused for their peer) so far."""
        self.conn.send(("refusals",))
        return self.conn.recv()

    def call(self, data: bytes, endpoint: str | None = None) -> bytes:
        """Send one raw frame, return the raw answer (the server must answer within 5 s)."""
        with zmq.Context.instance().socket(zmq.DEALER) as s:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint or self.tcp)
            s.send(data)
            assert s.poll(5000), "the block server did not answer"
            return s.recv()

    def fault(self, kind: str, seconds: float = 0.0) -> wire.Message:
        return self.codec.decode(self.call(self.codec.encode(wire.Fault(kind, seconds))))

    def close(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(10)


def transfer_params(transfer_id: str, tcp_endpoint: str) -> dict:
    """The kv_transfer_params a prefill node would hand out for ``transfer_id`` on this server."""
    from contracts.transfer import TransferParams

    return TransferParams(
        transfer_id=transfer_id,
        remote_block_ids=[],
        remote_endpoints={"tcp": tcp_endpoint},
        remote_host_id="test-host",
        remote_engine_id="test-engine",
        remote_num_tokens=0,
        lease_deadline=time.time() + 30,
    ).to_dict()
