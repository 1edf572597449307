"""Chained block hashes: how a trace says which prompts share which prefixes, at any block size.

A trace stores, for every request, one 64-bit hash per *base block* of its prompt (the trace's
``block_tokens``, e.g. 512 for Mooncake, 16 for our lake): ``h[i] = xxh64(h[i-1] ‖ c[i])`` with
``h[-1] = ROOT`` and ``c[i]`` the identity of block i's content (the Mooncake id, or the segments
of the conversation it covers). The last block may be partial (its content identity then says so,
so a longer continuation of it hashes differently). Because each hash is chained, ``h[i]`` names the
whole prefix ``[0, (i+1)·B)``: two requests with equal ``h[i]`` share their first ``(i+1)·B`` tokens,
and equal hashes at i imply equal hashes before i. That is what vLLM's prefix cache keys on too
(``hash(parent, tokens, extra)``), so hit accounting on these hashes is prefix-contiguous as vLLM's is.

Regrouping into another block size b (``regroup``), only ever over *full* blocks of the prompt
(an engine caches full blocks only):

- b a multiple of B (b = k·B): the hash of coarse block j is the chained hash of its last base
  block, ``h[(j+1)·k - 1]``: it names the same prefix, so sharing is exact.
- b a divisor of B (B = k·b): fine block j lies inside base block ``i = j // k`` at position
  ``j % k``; its hash is ``xxh64(h[i] ‖ j % k)``. This assumes what the trace itself says: a base
  block is shared whole or not at all (two prompts that share 700 of a 1,024-token base block are
  recorded as not sharing it). For a base block that is the prompt's partial last block, only the
  fine blocks it fills whole are kept.
- any other b: refused (``TraceError``), since the boundaries cannot be placed.

Tokens for a replay (``block_token_ids``): base block i's tokens are drawn from a generator seeded
with ``h[i]``; equal hashes give equal tokens, so the replayed prompts share exactly the token
prefixes the trace's hashes say they share, and an engine's prefix cache sees the same structure.
A partial last block takes the first tokens of the same draw.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

from contracts.errors import TandemError

ROOT = 0x7A4D_5EED_0000_0001
"""Parent of a prompt's first block (any constant: it only has to be the same for every request)."""

_MASK = (1 << 64) - 1


class TraceError(TandemError):
    """A trace file, a trace importer's input or a trace operation that cannot be used as asked."""


def chain(parent: int, content: bytes) -> int:
    """The chained hash of one block: its parent's hash and its content's identity."""
    return xxhash.xxh64_intdigest(struct.pack("<Q", parent & _MASK) + content)


def chain_ids(ids: Iterable[int]) -> list[int]:
    """Chained hashes of blocks whose contents are named by integer ids (Mooncake's ``hash_ids``)."""
    out: list[int] = []
    h = ROOT
    for block_id in ids:
        h = chain(h, struct.pack("<q", block_id))
        out.append(h)
    return out


Segment = tuple[str, int]
"""A run of prompt tokens: (identity of the run, its length in tokens). Equal identities, equal tokens."""


def chain_segments(segments: Sequence[Segment], block_tokens: int) -> list[int]:
    """Chained hashes of the base blocks of a prompt made of ``segments`` laid end to end.

    A block's content identity is the list of (segment, start, end) pieces it covers, so a prompt that
    extends another (same leading segments, more after) shares every block the shorter one fills
    whole, and its own last partial block hashes differently from a fuller block at the same place."""
    if block_tokens <= 0:
        raise TraceError(f"block_tokens must be positive, got {block_tokens}")
    out: list[int] = []
    h = ROOT
    pieces: list[str] = []
    filled = 0
    for name, length in segments:
        if length < 0:
            raise TraceError(f"segment {name!r} has a negative length {length}")
        start = 0
        while start < length:
            take = min(length - start, block_tokens - filled)
            pieces.append(f"{name}:{start}:{start + take}")
            filled += take
            start += take
            if filled == block_tokens:
                h = chain(h, "|".join(pieces).encode())
                out.append(h)
                pieces, filled = [], 0
    if filled:
        h = chain(h, ("|".join(pieces) + f"|partial:{filled}").encode())
        out.append(h)
    return out


def regroup(hashes: Sequence[int], input_tokens: int, base: int, block_size: int) -> list[int]:
    """The chained hashes of the *full* blocks of size ``block_size`` of a prompt of ``input_tokens``
    tokens whose base blocks (``base`` tokens each) hash to ``hashes``. See the module docstring."""
    if block_size <= 0 or base <= 0:
        raise TraceError(f"block sizes must be positive (base {base}, asked {block_size})")
    full = input_tokens // block_size
    if block_size % base == 0:
        k = block_size // base
        return [hashes[(j + 1) * k - 1] for j in range(full)]
    if base % block_size == 0:
        k = base // block_size
        return [chain(hashes[j // k], struct.pack("<I", j % k)) for j in range(full)]
    raise TraceError(
        f"block size {block_size} is neither a multiple nor a divisor of the trace's block size {base}: "
        "its block boundaries cannot be placed"
    )


def block_token_ids(block_hash: int, n: int, vocab: tuple[int, int]) -> np.ndarray:
    """``n`` token ids in ``[vocab[0], vocab[1])`` that stand for the block hashing to ``block_hash``
    (the same hash always gives the same ids; a shorter ``n`` gives a prefix of a longer one)."""
    rng = np.random.Generator(np.random.PCG64(block_hash))
    return rng.integers(vocab[0], vocab[1], size=n, dtype=np.int64)
