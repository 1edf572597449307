"""Routing keys that equal the engine's prefix-cache block hashes.

Decision: reproduce vLLM 0.32's chained block hash exactly, and key the index by the 64-bit form
that vLLM's KV events carry. For full block i of a prompt (``block_size`` tokens, only full blocks):

    h_i = H((h_{i-1} or NONE_HASH, tuple(tokens[i*bs:(i+1)*bs]), extra_keys_i))   # vLLM hash_block_tokens
    NONE_HASH = H(seed)                                                            # vLLM init_none_hash
    key_i = int.from_bytes(h_i, "big") & (2**64 - 1)                               # maybe_convert_block_hash

``H`` is the node's ``--prefix-caching-hash-algo`` (vllm/utils/hashing.py): ``sha256`` = SHA-256 of
``pickle.dumps(x, protocol=HIGHEST)``, ``sha256_cbor`` = SHA-256 of ``cbor2.dumps(x, canonical=True)``,
``xxhash``/``xxhash_cbor`` = xxh3-128 of the same. ``seed`` is ``PYTHONHASHSEED`` if the node sets it,
else ``"vllm-none-hash"`` for the sha256 algorithms; the xxhash ones use a random per-process seed
unless PYTHONHASHSEED is set, so they are only usable with an explicit shared seed.

What the nodes must run with (router settings must match):
    --enable-prefix-caching --prefix-caching-hash-algo sha256_cbor   (router: algo="sha256_cbor")
    PYTHONHASHSEED unset                                              (router: seed=None)
      or PYTHONHASHSEED=<s> on every node                              (router: seed="<s>")
    --block-size equal on every node of a model                       (router: block_size)
``sha256_cbor`` is recommended over vLLM's default ``sha256``: it does not depend on the pickle
implementation of the node's Python, so a router image and a node image can differ. Events may carry
the hashes as ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, vLLM's default) or as bytes (``=0``);
``external_key`` maps both to the same key.

Extra keys: ``cache_salt`` (first block only, as vLLM does) is supported. LoRA, multimodal and
prompt-embeds requests hash extra keys the router does not have; do not compute keys for them.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any, NewType

import cbor2

from contracts.errors import ConfigError
from contracts.transfer import block_key

BlockKey = NewType("BlockKey", int)
"""A block's routing key: the low 64 bits of vLLM's block hash, as KV events publish it."""

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's seed for NONE_HASH when PYTHONHASHSEED is unset and the algorithm is cryptographic."""

_MASK64 = (1 << 64) - 1


def external_key(block_hash: bytes | int) -> BlockKey:
    """Map a hash as the engine holds it (bytes) or publishes it (bytes or int) to a ``BlockKey``."""
    if isinstance(block_hash, bytes):
        return BlockKey(block_key(block_hash))
    return BlockKey(block_hash & _MASK64)


def _serialize_fn(algo: str) -> Callable[[Any], bytes]:
    if algo.endswith("_cbor"):
        return lambda x: cbor2.dumps(x, canonical=True)
    return lambda x: pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo.startswith("sha256"):
        return lambda b: hashlib.sha256(b).digest()
    try:
        import xxhash  # optional, as in vLLM
    except ImportError as exc:
        raise ConfigError(f"prefix-caching hash algo {algo!r} needs the xxhash package") from exc
    return xxhash.xxh3_128_digest


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """The Python-object hash function vLLM selects for ``--prefix-caching-hash-algo algo``."""
    if algo not in HASH_ALGOS:
        raise ConfigError(f"unknown prefix-caching hash algo {algo!r}; expected one of {HASH_ALGOS}")
    serialize, digest = _serialize_fn(algo), _digest_fn(algo)
    return lambda x: digest(serialize(x))


class BlockHasher:
    """Computes a model's routing keys; one per (model, block size), shared by the router process.

    A bounded memo maps (parent hash, block tokens) to the block hash, so a growing multi-turn
    prompt costs a hash only for its new blocks (agent traffic resends the same prefix every turn).
    """

    def __init__(
        self,
        block_size: int,
        algo: str = "sha256_cbor",
        seed: str | None = None,
        *,
        memo_blocks: int = 200_000,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        if algo.startswith("xxhash") and seed is None:
            raise ConfigError(
                f"{algo} uses a random per-process seed in vLLM; start the nodes with PYTHONHASHSEED "
                "and give the router the same seed, or use sha256_cbor"
            )
        self.block_size = block_size
        self.algo = algo
        self.seed = DEFAULT_NONE_HASH_SEED if seed is None else seed
        self._hash = hash_function(algo)
        self.none_hash: bytes = self._hash(self.seed)
        self._memo: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        self._memo_blocks = memo_blocks

    def block_hashes(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> list[bytes]:
        """vLLM's full block hashes (bytes) of every full block of ``token_ids``, in order."""
        bs = self.block_size
        parent = self.none_hash
        out: list[bytes] = []
        memo = self._memo
        for start in range(0, len(token_ids) - bs + 1, bs):
            block = tuple(token_ids[start : start + bs])
            if start == 0 and cache_salt:
                h = self._hash((parent, block, (("cache_salt", cache_salt),)))
            else:
                mk = (parent, block)
                h = memo.get(mk)  # type: ignore[assignment]
                if h is None:
                    h = self._hash((parent, block, None))
                    if len(memo) >= self._memo_blocks:
                        memo.clear()  # crude but bounded; refills from the live prefixes at once
                    memo[mk] = h
            out.append(h)
            parent = h
        return out

    def keys(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> list[BlockKey]:
        """Routing keys of every full block of ``token_ids`` (a partial last block has none)."""
        return [external_key(h) for h in self.block_hashes(token_ids, cache_salt=cache_salt)]

    def first_block_matches(self, token_ids: Sequence[int], key: BlockKey) -> bool:
        """Whether the engine's key for a chain's first block is ours: a cheap check, on live events,
        that the nodes run with the algorithm and seed this hasher was configured with."""
        if len(token_ids) < self.block_size:
            return False
        return self.keys(token_ids[: self.block_size])[0] == key


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256_cbor",
    seed: str | None = None,
    cache_salt: str | None = None,
) -> list[BlockKey]:
    """One-off form of ``BlockHasher(block_size, algo, seed).keys(token_ids)``; build a ``BlockHasher``
    once per model on the request path instead (it memoizes shared prefixes)."""
    return BlockHasher(block_size, algo, seed).keys(token_ids, cache_salt=cache_salt)
