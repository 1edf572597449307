"""Per-node KV cache activity for the lake: the engines' KV events, counted per node and interval, as
``kv_events`` rows (telemetry.schemas). Counting is O(1) per event in the subscriber's callback; rows
leave through the emitter from a job of the router's periodic loop (``router.housekeeping``), never
from the event path."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from router.housekeeping import Housekeeping
from router.kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from telemetry import Emitter


@dataclass
class _Counts:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    events: int = 0


class KVActivity:
    def __init__(
        self, emitter: Emitter, node_info: Callable[[str], tuple[str, float] | None], interval_s: float = 10.0
    ) -> None:
        """``node_info(node_id)`` gives (role, kv_usage) of a live node, or None."""
        self._emitter = emitter
        self._node_info = node_info
        self._interval_s = interval_s
        self._counts: dict[str, _Counts] = {}
        self._since = time.time()

    def observe(self, node_id: str, event: KVEvent) -> None:
        c = self._counts.setdefault(node_id, _Counts())
        c.events += 1
        if isinstance(event, BlockStored):
            c.stored += len(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            c.removed += len(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            c.cleared += 1

    def flush(self) -> int:
        """Emit one row per node that had events since the last flush; returns the rows emitted."""
        now, since = time.time(), self._since
        counts, self._counts, self._since = self._counts, {}, now
        for node_id, c in counts.items():
            role, usage = self._node_info(node_id) or (None, None)
            self._emitter.emit(
                "kv_events",
                {
                    "node_id": node_id,
                    "role": role,
                    "interval_start": since,
                    "interval_end": now,
                    "blocks_stored": c.stored,
                    "blocks_removed": c.removed,
                    "all_blocks_cleared": c.cleared,
                    "num_events": c.events,
                    "kv_usage": usage,
                },
            )
        return len(counts)

    def start(self, housekeeping: Housekeeping) -> None:
        housekeeping.every(self._interval_s, self.flush, name="kv-activity")  # the aggregation period

    def stop(self) -> None:
        """The last interval's rows (the housekeeping loop, stopped first, runs no more rounds)."""
        self.flush()
