"""SIMULATOR: a trace's block keys at a node's block size, for the whole trace at once (numpy).

The structure is ``traces.hashing.regroup``'s: a coarse block (a multiple k of the trace's base size)
takes the chained hash of its last base block; a fine block (a divisor) takes a mix of its base block's
hash and its position inside it. The mix here is splitmix64's finaliser in numpy, not regroup's
xxh64, because regrouping a Mooncake-sized trace one block at a time in Python took longer than
simulating it; inside a simulation only equality of keys matters, and equal keys still mean equal
prefixes (the base hash names the prefix, the position the offset in it). Prepared once per trace
and block size (``prepare``) and shared by every run of a search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from traces.hashing import TraceError
from traces.schema import Trace

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(h: np.ndarray, pos: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = h ^ ((pos.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        out: np.ndarray = x ^ (x >> np.uint64(31))
        return out


@dataclass(frozen=True)
class PreparedTrace:
    """A trace's columns as arrays, plus its keys at ``block_size`` (request i's are
    ``keys[offsets[i]:offsets[i + 1]]``, one per full block of its prompt)."""

    trace: Trace
    block_size: int
    request_id: list[str]
    session_id: list[str | None]
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    keys: np.ndarray
    offsets: np.ndarray
    parent: np.ndarray
    """Index of each request's parent (its previous turn) in the trace, -1 when it has none there."""
    gap_s: np.ndarray
    """The recorded gap after the parent's end (NaN: none recorded)."""

    def __len__(self) -> int:
        return len(self.request_id)

    def keys_of(self, i: int) -> list[int]:
        return self.keys[self.offsets[i] : self.offsets[i + 1]].tolist()  # type: ignore[no-any-return]


def prepare(trace: Trace, block_size: int) -> PreparedTrace:
    base = trace.meta.block_tokens
    if block_size <= 0 or not (block_size % base == 0 or base % block_size == 0):
        raise TraceError(
            f"block size {block_size} is neither a multiple nor a divisor of the trace's block size {base}: "
            "its block boundaries cannot be placed"
        )
    t = trace.table
    n_in = t.column("input_tokens").to_numpy().astype(np.int64)
    hashes = t.column("block_hashes").combine_chunks()
    values = hashes.values.to_numpy().astype(np.uint64)
    starts = hashes.offsets.to_numpy()[:-1].astype(np.int64)
    full = n_in // block_size
    offsets = np.zeros(len(full) + 1, dtype=np.int64)
    np.cumsum(full, out=offsets[1:])
    owner = np.repeat(np.arange(len(full)), full)
    j = np.arange(offsets[-1], dtype=np.int64) - offsets[owner]  # block index within its prompt
    if block_size % base == 0:
        keys = values[starts[owner] + (j + 1) * (block_size // base) - 1]
    else:
        k = base // block_size
        keys = _mix(values[starts[owner] + j // k], j % k)
    ids = t.column("request_id").to_pylist()
    where = {rid: i for i, rid in enumerate(ids)}
    parent = np.array([where.get(p, -1) if p is not None else -1 for p in t.column("parent_request_id").to_pylist()])
    gap = np.array([np.nan if g is None else g for g in t.column("gap_s").to_pylist()], dtype=np.float64)
    return PreparedTrace(
        trace=trace,
        block_size=block_size,
        request_id=ids,
        session_id=t.column("session_id").to_pylist(),
        arrival_s=t.column("arrival_s").to_numpy(),
        input_tokens=n_in,
        output_tokens=t.column("output_tokens").to_numpy().astype(np.int64),
        keys=keys,
        offsets=offsets,
        parent=parent.astype(np.int64),
        gap_s=gap,
    )
