"""The CUDA IPC path's logic on its CPU stand-in: a cache in shared memory exported as handles,
opened (mapped, not copied), and leased blocks copied into our own cache run by run."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.device.backend import CpuBackend
from kv_transfer.device.ipc import export_parts, open_parts, pull_ipc
from kv_transfer.device.staging import DeviceKV

BLOCKS = 10


def _kv(fill: bool) -> DeviceKV:
    caches = []
    for i in range(2):
        t = (
            torch.arange(2 * BLOCKS * 32, dtype=torch.int32).reshape(2, BLOCKS, 32) * (i + 1)
            if fill
            else torch.zeros(2, BLOCKS, 32, dtype=torch.int32)
        )
        caches.append(t.share_memory_())
    return DeviceKV(caches, BLOCKS, mirror=True)


def test_opened_handles_map_the_peers_memory() -> None:
    src = _kv(True)
    peer = open_parts(export_parts(src))
    assert [p.shape for p in peer] == [p.shape for p in src.parts]
    src.parts[0][3, 0] = 201
    assert int(peer[0][3, 0]) == 201  # the same memory, not a copy


def test_pull_ipc_copies_the_leased_blocks_to_their_local_places() -> None:
    src, dst = _kv(True), _kv(False)
    peer = open_parts(export_parts(src))
    remote, local = [1, 2, 3, 7], [5, 6, 0, 1]
    pull_ipc(CpuBackend(), dst, peer, remote, local).synchronize()
    for p in range(len(src.parts)):
        assert torch.equal(dst.parts[p][local], src.parts[p][remote])
        assert not dst.parts[p][[2, 3, 4, 7, 8, 9]].any()


def test_pull_ipc_refuses_mismatched_lists_and_layouts() -> None:
    src, dst = _kv(True), _kv(False)
    peer = open_parts(export_parts(src))
    with pytest.raises(ValueError, match="length"):
        pull_ipc(CpuBackend(), dst, peer, [1, 2], [1])
    with pytest.raises(ValueError, match="layout"):
        pull_ipc(CpuBackend(), dst, peer[:1], [1], [1])


def test_a_private_cpu_cache_is_not_exported() -> None:
    kv = DeviceKV([torch.zeros(BLOCKS, 8)], BLOCKS, mirror=True)
    with pytest.raises(ValueError, match="shared memory"):
        export_parts(kv)
