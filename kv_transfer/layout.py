"""The engine's paged KV cache seen as bytes: one array per layer, block-major, so the bytes of
``count`` consecutive blocks of one layer are one contiguous range that can be sent from, received
into or copied across processes without staging."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kv_transfer.wire import Segment


@dataclass
class KVLayout:
    layers: list[np.ndarray]
    """Per layer, a uint8 view of shape (num_blocks, block_nbytes) over the engine's own memory."""
    dtype: str
    block_shape: list[int]
    addresses: tuple[int, ...] = field(init=False)
    """Address of block 0 of each layer. The engine allocates its cache once, so these never change;
    they are read once here (``ndarray.ctypes.data`` costs microseconds a call, and every shm pull
    and Grant names all of them)."""

    def __post_init__(self) -> None:
        self.addresses = tuple(int(a.ctypes.data) for a in self.layers)

    @classmethod
    def from_arrays(cls, arrays: list[np.ndarray], dtype: str | None = None) -> KVLayout:
        if not arrays:
            raise ValueError("no KV cache layers")
        layers = []
        for a in arrays:
            if not a.flags.c_contiguous:
                raise ValueError("KV cache layers must be contiguous")
            layers.append(a.view(np.uint8).reshape(a.shape[0], -1))
        return cls(layers, dtype or str(arrays[0].dtype), list(arrays[0].shape[1:]))

    @classmethod
    def from_torch(cls, caches: dict[str, Any], num_blocks: int) -> KVLayout:
        """From vLLM's ``register_kv_caches`` dict (layer name → tensor), in the engine's layer order.
        Needs host-memory caches with blocks on the first axis (vLLM's CPU attention backend:
        [num_blocks, num_kv_heads, block_size, 2 * head_size])."""
        import torch

        arrays = []
        first = next(iter(caches.values()))
        for name, t in caches.items():
            if t.device.type != "cpu":
                raise ValueError(
                    f"layer {name}: the tandem connector moves host-memory KV caches only "
                    f"(got {t.device}); use the nixl connector on accelerators"
                )
            if t.shape[0] != num_blocks or not t.is_contiguous():
                raise ValueError(
                    f"layer {name}: expected a contiguous cache with {num_blocks} blocks on "
                    f"axis 0, got shape {tuple(t.shape)}"
                )
            arrays.append(t.view(torch.uint8).numpy().reshape(num_blocks, -1))
        return cls(arrays, str(first.dtype).removeprefix("torch."), list(first.shape[1:]))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def block_nbytes(self) -> int:
        return int(self.layers[0].shape[1])

    def span(self, layer: int, start: int, count: int) -> np.ndarray:
        """The bytes of blocks [start, start + count) of one layer, as a writable view (no copy)."""
        return self.layers[layer][start : start + count].reshape(-1)

    def address(self, layer: int) -> int:
        return self.addresses[layer]

    def nbytes(self, segments: list[Segment]) -> int:
        return sum(s.count for s in segments) * self.block_nbytes * self.num_layers


def checksum(span: Any) -> int:
    """xxh3-64 of a span of the cache, or of a frame: any buffer (numpy's stubs do not call an ndarray one)."""
    return int(xxhash.xxh3_64_intdigest(span))
