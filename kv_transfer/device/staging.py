"""An engine's paged KV cache on any device, with a host mirror the connector's block server and
puller work on unchanged.

vLLM lays a layer's cache out block-major on the CPU backend (``[num_blocks, ...]``) and K/V-major
on the GPU attention backends (``[2, num_blocks, ...]``: all K blocks, then all V blocks). Either way
a block's bytes of one part (the layer, or its K or its V half) are one contiguous range, so the
cache is seen here as a list of *parts*, each a ``[num_blocks, block_part_nbytes]`` uint8 view of
the engine's own memory: one part per layer block-major, two per layer K/V-major.

``host`` is a ``KVLayout`` over pinned staging buffers of the same shape (block ``b`` of part ``p``
at the same place): the block server serves from it and the puller receives into it exactly as
from a host cache, so every transport, lease, checksum and layer-wise rule of today's path applies
to GPU caches. ``stage_out`` copies blocks device-to-host before they are offered (or, layer-wise,
each layer once the engine has written it); ``stage_in`` copies pulled blocks host-to-device. Both
run on the backend's side stream behind an event of the engine's stream and hand back events:
nothing here synchronizes the engine's stream. On a CPU cache the device memory *is* host memory,
so ``host`` is the cache itself and the stages are no-ops (today's path, unchanged).

Checksums are xxh3-64 (``kv_transfer.layout.checksum``, the same function as the host path) over
the staging copy: the bytes that leave the host are hashed once on the way out by the block server
and once on the way in by the puller, with no extra device pass; the device-to-host and
host-to-device copies themselves are DMA copies the driver reports errors on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.device.backend import Backend, CpuBackend, Event, backend_of
from kv_transfer.layout import KVLayout, checksum

Pair = tuple[torch.Tensor, torch.Tensor]
"""(destination, source) of one copy."""


@dataclass(frozen=True)
class PartMap:
    """How many device parts make one engine layer (1: block-major, 2: K/V-major)."""

    per_layer: int

    def parts_of(self, layers: range | list[int]) -> list[int]:
        return [layer * self.per_layer + k for layer in layers for k in range(self.per_layer)]


def device_parts(caches: list[torch.Tensor], num_blocks: int) -> tuple[list[torch.Tensor], PartMap]:
    """The uint8 ``[num_blocks, nbytes]`` parts of per-layer caches in either vLLM layout."""
    if not caches:
        raise ValueError("no KV cache layers")
    parts: list[torch.Tensor] = []
    per_layer = 0
    for i, t in enumerate(caches):
        if not t.is_contiguous():
            raise ValueError(f"layer {i}: KV cache must be contiguous")
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        if t.shape[0] == num_blocks:
            n = 1
            parts.append(raw.reshape(num_blocks, -1))
        elif t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            n = 2
            halves = raw.reshape(2, num_blocks, -1)
            parts += [halves[0], halves[1]]
        else:
            raise ValueError(
                f"layer {i}: expected {num_blocks} blocks on axis 0 (block-major) or axis 1 after a K/V "
                f"axis of 2, got shape {tuple(t.shape)}"
            )
        if per_layer and n != per_layer:
            raise ValueError(f"layer {i}: layout differs from layer 0")
        per_layer = n
    return parts, PartMap(per_layer)


class DeviceKV:
    def __init__(
        self, caches: list[torch.Tensor], num_blocks: int, backend: Backend | None = None, *, mirror: bool | None = None
    ) -> None:
        """``mirror``: keep a staging copy even of a host cache (the CPU rehearsal of the GPU path);
        by default only device caches have one."""
        self.backend = backend or backend_of(caches[0])
        self.parts, self.map = device_parts(caches, num_blocks)
        self.num_blocks = num_blocks
        self.num_layers = len(caches)
        on_cpu = caches[0].device.type == "cpu" and isinstance(self.backend, CpuBackend)
        self.on_host = on_cpu and not mirror
        if self.on_host:
            self.staging = self.parts  # the cache is host memory already: serve it in place
        else:
            self.staging = [self.backend.host_buffer(p.numel()).view(p.shape) for p in self.parts]
        # the wire's layers are these parts; dtype and part shape are what both ends compare
        dtype = str(caches[0].dtype).removeprefix("torch.")
        self.host = KVLayout([s.numpy() for s in self.staging], dtype, [int(self.parts[0].shape[1])])

    @classmethod
    def from_vllm(cls, caches: dict[str, torch.Tensor], num_blocks: int) -> DeviceKV:
        """From vLLM's ``register_kv_caches`` dict (layer name → tensor), in the engine's layer order;
        CUDA caches included."""
        return cls(list(caches.values()), num_blocks)

    @property
    def block_part_nbytes(self) -> int:
        return int(self.parts[0].shape[1])

    def _pairs(self, out: bool, parts: list[int], runs: list[tuple[int, int]]) -> list[Pair]:
        pairs: list[Pair] = []
        for p in parts:
            for start, count in runs:
                dev, host = self.parts[p][start : start + count], self.staging[p][start : start + count]
                pairs.append((host, dev) if out else (dev, host))
        return pairs

    def stage_out(self, block_ids: list[int], layers: range | list[int] | None = None) -> Event:
        """Queue the device-to-host copy of ``block_ids`` of ``layers`` (all by default) behind the
        engine's work so far; the returned event completes when the staging copy holds them."""
        return self._stage(True, block_ids, layers)

    def stage_in(self, block_ids: list[int], layers: range | list[int] | None = None) -> Event:
        """Queue the host-to-device copy of pulled blocks into the engine's cache."""
        return self._stage(False, block_ids, layers)

    def _stage(self, out: bool, block_ids: list[int], layers: range | list[int] | None) -> Event:
        if self.on_host:
            return self.backend.engine_mark()
        parts = self.map.parts_of(range(self.num_layers) if layers is None else layers)
        return self.backend.copy(self._pairs(out, parts, runs_of(block_ids)), self.backend.engine_mark())

    def checksums(self, block_ids: list[int]) -> list[int]:
        """xxh3-64 per part of the staged ``block_ids`` (the host path's function, on the staging copy)."""
        out = []
        for s in self.host.layers:
            out.append(checksum(s[block_ids].tobytes()))
        return out


def runs_of(block_ids: list[int]) -> list[tuple[int, int]]:
    """(start, count) runs of consecutive block ids, in order: one copy per run."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def describe(kv: DeviceKV) -> dict[str, Any]:
    return {
        "device": kv.backend.name,
        "layers": kv.num_layers,
        "parts_per_layer": kv.map.per_layer,
        "blocks": kv.num_blocks,
        "block_part_nbytes": kv.block_part_nbytes,
    }
