from __future__ import annotations

from typing import Any

from router.kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored
from router.record.kv_activity import KVActivity


class _Sink:
    """Stands in for the Emitter: the unit under test is the aggregation, not the transport."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, dict[str, Any]]] = []

    def emit(self, table: str, record: dict[str, Any]) -> bool:
        self.rows.append((table, record))
        return True


def test_events_aggregate_per_node_and_interval() -> None:
    sink = _Sink()
    act = KVActivity(sink, lambda node: ("prefill", 0.25) if node == "p" else None)  # type: ignore[arg-type]
    act.observe("p", BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=[], block_size=16))
    act.observe("p", BlockRemoved(block_hashes=[1]))
    act.observe("d", AllBlocksCleared())
    assert act.flush() == 2
    rows = {r["node_id"]: r for table, r in sink.rows if table == "kv_events"}
    assert (rows["p"]["blocks_stored"], rows["p"]["blocks_removed"], rows["p"]["num_events"]) == (3, 1, 2)
    assert (rows["p"]["role"], rows["p"]["kv_usage"]) == ("prefill", 0.25)
    assert rows["d"]["all_blocks_cleared"] == 1 and rows["d"]["role"] is None
    assert rows["p"]["interval_start"] <= rows["p"]["interval_end"]
    assert act.flush() == 0  # counts start again from zero
