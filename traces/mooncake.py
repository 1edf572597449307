"""``tandem trace import mooncake FILE``: a Mooncake FAST'25 trace (JSON lines) into a Tandem trace.

Each line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``, one id
per 512-token block of the prompt (the last possibly partial). The ids become chained hashes
(``traces.hashing.chain_ids``), so the base block size is 512 and the trace can be regrouped.

Sessions are not in the file. With ``infer_sessions`` (the default) they are inferred, and the notes
say so: a request's parent is the latest earlier request whose *full* blocks are all a prefix of this
request's blocks, provided that shared prefix is at least ``min_shared_blocks`` blocks (so that two
requests that share only a system prompt are not made one session); a request without one starts a
session. This is what a conversation's next turn looks like (the whole previous prompt, then the
answer and the new message). Service times are not recorded either, so ``gap_s`` stays null: a
closed-loop replay then keeps the recorded spacing of a turn after its parent (see ``replay``).
"""

from __future__ import annotations

import json
from pathlib import Path

from traces.hashing import TraceError, chain_ids
from traces.schema import Trace, TraceMeta, add_row, empty_columns, make_trace

MOONCAKE_BLOCK_TOKENS = 512


def import_mooncake(path: Path, *, infer_sessions: bool = True, min_shared_blocks: int = 2) -> Trace:
    rows: list[tuple[float, int, int, list[int]]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc})") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            ts, n_in, n_out, ids = d["timestamp"], d["input_length"], d["output_length"], d["hash_ids"]
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from exc
        ok = all(isinstance(v, int) for v in (n_in, n_out)) and isinstance(ts, int | float)
        if not ok or not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise TraceError(f"{path}:{lineno}: timestamp, input_length, output_length must be numbers, hash_ids ints")
        if n_in <= 0 or len(ids) != -(-n_in // MOONCAKE_BLOCK_TOKENS):
            raise TraceError(
                f"{path}:{lineno}: {len(ids)} hash_ids for input_length {n_in} "
                f"(expected one per {MOONCAKE_BLOCK_TOKENS}-token block)"
            )
        rows.append((ts / 1000.0, n_in, n_out, ids))
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]

    cols = empty_columns()
    # hash of a request's last full block -> (request id, session id, turn): the requests a later one
    # may extend
    ends: dict[int, tuple[str, str, int]] = {}
    sessions = 0
    for i, (ts, n_in, n_out, ids) in enumerate(rows):
        rid = f"r{i}"
        hashes = chain_ids(ids)
        full = n_in // MOONCAKE_BLOCK_TOKENS
        parent: tuple[str, str, int] | None = None
        if infer_sessions:
            for j in range(min(full, len(hashes)) - 1, min_shared_blocks - 2, -1):
                if (hit := ends.get(hashes[j])) is not None:
                    parent = hit
                    break
        if parent is None:
            sid, turn, parent_id = f"s{sessions}", 0, None
            sessions += 1
        else:
            parent_id, sid, turn = parent[0], parent[1], parent[2] + 1
        if infer_sessions and full >= min_shared_blocks:
            ends[hashes[full - 1]] = (rid, sid, turn)
        add_row(
            cols,
            request_id=rid,
            session_id=sid if infer_sessions else None,
            parent_request_id=parent_id,
            turn=turn if infer_sessions else 0,
            arrival_s=ts - t0,
            input_tokens=n_in,
            output_tokens=n_out,
            block_hashes=hashes,
        )
    notes = "gap_s unknown (no service times recorded)"
    if infer_sessions:
        notes += (
            f"; sessions inferred: parent = latest earlier request whose full blocks prefix this one "
            f"(>= {min_shared_blocks} blocks)"
        )
    return make_trace(cols, TraceMeta(MOONCAKE_BLOCK_TOKENS, f"mooncake:{path.name}", notes))
