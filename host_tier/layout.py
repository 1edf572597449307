"""What a tier block's bytes mean, as one 32-byte fingerprint, and how big a block is.

Two engines may share a tier block only if they would compute the same bytes for it: same model
weights, KV dtype, block size, layer and head layout, and the same block-hash algorithm and seed (the
key is the engine's own block hash, which already folds in the parent chain and the ``cache_salt``
that keeps tenants apart). Everything that decides that goes into the fingerprint; the tier file
records it and a client with another fingerprint is refused (``client.py``), so a mismatch is a clear
error at start, never a silent 0% hit rate or, worse, a wrong block.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BlockLayout:
    model: str
    """The model's identity (its folder name or Hugging Face id plus revision)."""
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None
    """PYTHONHASHSEED of the engines, None when unset (vLLM then uses a fixed seed for sha256*)."""

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}[self.dtype]

    @property
    def block_bytes(self) -> int:
        """K and V of every layer for one block."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def fingerprint(self) -> bytes:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).digest()
