"""The worker's device glue with events that complete when the test says: nothing reaches the block
server before its staging copy is complete, fills keep the engine's layer order, a pull is reported
only once its blocks are in the cache, and a host cache passes straight through."""

from __future__ import annotations

import torch

from kv_transfer.device.backend import CpuBackend
from kv_transfer.device.staging import DeviceKV
from kv_transfer.device.worker_glue import DeviceWorkerGlue

BLOCKS = 8


class Gate:
    def __init__(self) -> None:
        self.open = False

    def query(self) -> bool:
        return self.open

    def synchronize(self) -> None:
        raise AssertionError("the glue must never wait for a copy")


class Gated(CpuBackend):
    """Copies at once but reports each copy complete only when its gate is opened."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: list[Gate] = []

    def copy(self, pairs, after):  # noqa: ANN001, ANN201
        super().copy(pairs, None)
        self.gates.append(Gate())
        return self.gates[-1]


class Server:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def offer(self, transfer_id: str, block_ids: list[int], deadline: float) -> None:
        self.calls.append(("offer", transfer_id, block_ids))

    def fill(self, transfer_id: str, layers: int, block_ids: list[int] | None = None, *, done: bool = False) -> None:
        self.calls.append(("fill", transfer_id, layers, block_ids, done))


def _kv(backend: CpuBackend | None = None, mirror: bool = True) -> DeviceKV:
    return DeviceKV([torch.zeros(2, BLOCKS, 4) for _ in range(3)], BLOCKS, backend, mirror=mirror)


def test_offers_and_fills_wait_for_their_copies_and_keep_order() -> None:
    backend, server = Gated(), Server()
    glue = DeviceWorkerGlue(_kv(backend))
    glue.layer_written(server, "lw", 0, [1, 2], done=False)
    glue.layer_written(server, "lw", 1, [1, 2], done=False)
    glue.offer(server, "whole", [5], 99.0)
    assert server.calls == [] and glue.in_flight == 3
    backend.gates[1].open = True  # layer 1's copy done before layer 0's: still not served
    assert glue.poll(server) == 0 and server.calls == []
    backend.gates[0].open = True
    assert glue.poll(server) == 2
    assert server.calls == [("fill", "lw", 2, [1, 2], False), ("fill", "lw", 4, None, False)]  # 2 parts a layer
    backend.gates[2].open = True
    glue.poll(server)
    assert server.calls[-1] == ("offer", "whole", [5]) and glue.in_flight == 0


def test_a_pull_is_received_once_its_blocks_are_in_the_cache() -> None:
    backend = Gated()
    glue = DeviceWorkerGlue(_kv(backend))
    glue.pulled("r1", [0, 1])
    glue.pulled("r2", [4])
    assert glue.received() == set()
    backend.gates[1].open = True
    assert glue.received() == {"r2"}
    backend.gates[0].open = True
    assert glue.received() == {"r1"} and glue.in_flight == 0


def test_a_host_cache_passes_straight_through() -> None:
    server = Server()
    glue = DeviceWorkerGlue(_kv(mirror=False))
    glue.offer(server, "t", [3], 1.0)
    glue.layer_written(server, "lw", 0, [2], done=True)
    glue.pulled("r", [1])
    assert server.calls == [("offer", "t", [3]), ("fill", "lw", 2, [2], True)]
    assert glue.received() == {"r"}
