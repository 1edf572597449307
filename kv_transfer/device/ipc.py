"""Same-host pulls that skip the host copy: the prefill process exports its cache parts as IPC
handles once, the decode process opens them and copies leased blocks device-to-device (same GPU or
another one over NVLink/PCIe peer access) into its own cache, on its side stream.

The handles are torch's own (``torch.multiprocessing`` reductions: ``cudaIpcGetMemHandle`` on the
storage, with torch's reference counting that keeps the exporter's memory alive while mapped). The
CPU stand-in is the same call on a cache in shared memory (the ``file_system`` sharing strategy:
a named shm segment), so CI runs this module's logic end to end. A handle is a pickle: it is only
ever opened from the proven peer of a one-host socket (the same trust as ``shm``'s pid check), never
from the network.

No checksum is computed on this path: the bytes never leave device memory and the copy is one DMA
the driver reports errors on; the bench checks equality after the fact with the host path's xxh3.
"""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as tmp

from kv_transfer import wire
from kv_transfer.device.backend import Backend, Event
from kv_transfer.device.staging import DeviceKV


def export_parts(kv: DeviceKV) -> list[bytes]:
    """One handle per cache part; CPU caches must already be in shared memory (``share_memory_``
    before the cache is first used: it moves the storage)."""
    handles = []
    for p in kv.parts:
        if p.device.type == "cpu":
            if not p.is_shared():  # type: ignore[no-untyped-call]
                raise ValueError("a CPU cache must be in shared memory to be exported")
            tmp.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
        handles.append(bytes(ForkingPickler.dumps(p)))
    return handles


def open_parts(handles: list[bytes]) -> list[torch.Tensor]:
    """The peer's cache parts, mapped into this process (no copy)."""
    return [pickle.loads(h) for h in handles]  # noqa: S301 - from the proven same-host peer only


def pull_ipc(
    backend: Backend,
    dst: DeviceKV,
    src_parts: list[torch.Tensor],
    remote_ids: list[int],
    local_ids: list[int],
    layers: range | list[int] | None = None,
) -> Event:
    """Queue the device-to-device copy of the peer's ``remote_ids`` into our ``local_ids``."""
    if len(remote_ids) != len(local_ids):
        raise ValueError("remote and local block lists differ in length")
    same = len(src_parts) == len(dst.parts) and all(
        s.shape[1] == d.shape[1] for s, d in zip(src_parts, dst.parts, strict=True)
    )
    if not same:
        raise ValueError("peer cache layout differs from ours")
    parts = dst.map.parts_of(range(dst.num_layers) if layers is None else layers)
    pairs = []
    for p in parts:
        for s in wire.segments_of(remote_ids, local_ids):
            pairs.append((dst.parts[p][s.local : s.local + s.count], src_parts[p][s.remote : s.remote + s.count]))
    return backend.copy(pairs, backend.engine_mark())
