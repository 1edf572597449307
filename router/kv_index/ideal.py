"""The hit rate a single prefix cache of unlimited size would reach on a request sequence.

For each request in order: its hit is the longest prefix of whole blocks that also began any earlier
request (whole-block prefixes chain, so "seen" means the same tokens from position 0 up to that block
boundary), capped like vLLM's at (tokens - 1) // block_size blocks since the engine always computes a
prompt's last token. Then every full block of the request counts as seen. The hit rate is hit tokens
over prompt tokens. Keys are exact (interned chains of token tuples), so no hash can collide.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def ideal_cached_tokens(requests_token_ids: Iterable[Sequence[int]], block_size: int) -> list[int]:
    """Per request, the tokens an unlimited cache would have held for it."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    seen: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent chain id, block tokens) -> chain id
    out: list[int] = []
    for tokens in requests_token_ids:
        n = len(tokens)
        cap = (n - 1) // block_size if n else 0
        parent = 0
        hit_blocks = 0
        matching = True
        for i, start in enumerate(range(0, n - block_size + 1, block_size)):
            key = (parent, tuple(tokens[start : start + block_size]))
            chain = seen.get(key)
            if chain is None:
                matching = False
                chain = seen[key] = len(seen) + 1
            elif matching:
                hit_blocks = i + 1
            parent = chain
        out.append(min(hit_blocks, cap) * block_size)
    return out


def ideal_hit_rate(requests_token_ids: Sequence[Sequence[int]], block_size: int) -> float:
    """Hit tokens / prompt tokens over the sequence (0.0 for no tokens)."""
    total = sum(len(t) for t in requests_token_ids)
    if total == 0:
        return 0.0
    return sum(ideal_cached_tokens(requests_token_ids, block_size)) / total
