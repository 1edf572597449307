"""The host tier's statistics for the lake: one ``host_tier`` row (``telemetry.schemas``) per interval.

The server loop owns the tier's counters (``TierStats``, cumulative since the server started) and is
single-threaded, and it must never wait on Redis. So, as for /metrics (``metrics.py``), the loop offers
a snapshot once a second (``TierLake.tick``); at most once per ``interval_s`` the difference from the
previous snapshot becomes a row, handed to ``Emitter.emit``: one deque append. The emitter's own thread
builds the Arrow batch and talks to Redis (``telemetry.emitter``), so a slow or dead Redis costs rows
(the emitter drops them, with a warning in the log), never a lookup's latency.

A row holds the gauges at the interval's end (blocks by state, pinned bytes) and the counters' deltas
over it. Evictions and forgotten blocks are counted by reason: each reason known here (the policy's
``lru`` and ``pinned_lru``, the client's ``corrupt``) has a column of its own, so a query sums it
without parsing; any other reason (the policy's ``pinned_spare``) goes into a JSON column
(``{"reason": blocks}``), so a reason added later reaches the lake before its column does.

The last interval's row is emitted when the server stops (``close``), so the rows of one server run sum
to its counters. A restarted server counts from zero again; its rows start a new series (the counters
are per run, the deltas are what a query sums).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from host_tier.messages import TierStats
from host_tier.settings import TierSettings
from telemetry.emitter import Emitter, EmitterConfig

TABLE = "host_tier"

EVICTION_COLUMNS = {"lru": "evicted_lru", "pinned_lru": "evicted_pinned_lru"}
"""Eviction reasons (``eviction.EvictionPolicy.victim``) with a column of their own."""
FORGOTTEN_COLUMNS = {"corrupt": "forgotten_corrupt"}
"""Forget reasons (``client.TierClient``) with a column of their own."""


@dataclass(frozen=True, slots=True)
class TierIdentity:
    """Which tier the rows are about (the same in every row of a run)."""

    tier_id: str
    host: str
    model: str
    layout_fingerprint: str
    """Hex."""

    @classmethod
    def of(cls, path: Path, model: str, fingerprint: bytes) -> TierIdentity:
        """One tier per host and layout: the host and its file name it."""
        host = socket.gethostname()
        return cls(f"{host}:{path}", host, model, fingerprint.hex())


def _by_reason(before: dict[str, int], after: dict[str, int], columns: dict[str, str], other: str) -> dict[str, Any]:
    """The interval's counts per reason: known reasons in their columns (0 when none), the rest as JSON
    in ``other`` (None when none)."""
    delta = {reason: n - before.get(reason, 0) for reason, n in after.items() if n != before.get(reason, 0)}
    out: dict[str, Any] = {column: delta.pop(reason, 0) for reason, column in columns.items()}
    out[other] = json.dumps(delta, sort_keys=True) if delta else None
    return out


def interval_row(
    identity: TierIdentity, before: TierStats | None, after: TierStats, start: float, end: float
) -> dict[str, Any]:
    """The ``host_tier`` row of the interval [start, end] (epoch seconds) between two snapshots of one
    run; ``before`` None: the run's first interval, from the server's start (its counters start at 0)."""
    if before is None:
        before = TierStats(after.n_slots, after.slot_bytes, 0, 0, 0, 0, 0, 0, {}, {}, 0)
    return {
        "tier_id": identity.tier_id,
        "host": identity.host,
        "model": identity.model,
        "layout_fingerprint": identity.layout_fingerprint,
        "interval_start": start,
        "interval_end": end,
        "slots": after.n_slots,
        "slot_bytes": after.slot_bytes,
        "blocks_held": after.held,
        "blocks_writing": after.writing,
        "blocks_pinned": after.pinned,
        "pinned_bytes": after.pinned * after.slot_bytes,
        "stored": after.stored - before.stored,
        "hits": after.hits - before.hits,
        "misses": after.misses - before.misses,
        "pinned_hits": after.pinned_hits - before.pinned_hits,
        **_by_reason(before.evictions, after.evictions, EVICTION_COLUMNS, "evicted_other"),
        **_by_reason(before.forgotten, after.forgotten, FORGOTTEN_COLUMNS, "forgotten_other"),
        "pins_refused": after.pins_refused - before.pins_refused,
        "demoted": after.demoted - before.demoted,
        "reclaimed": after.reclaimed - before.reclaimed,
    }


class TierLake:
    """Rows of one server run. Called only from the server loop (no lock): ``tick`` once a second,
    ``close`` once at the end."""

    def __init__(
        self, emitter: Emitter, identity: TierIdentity, interval_s: float = 10.0, clock: Callable[[], float] = time.time
    ) -> None:
        """Built before the server starts: the first interval counts from here, from zero."""
        self.emitter = emitter
        self.identity = identity
        self.interval_s = interval_s
        self.clock = clock
        self._last: TierStats | None = None
        self._since = clock()

    def tick(self, stats: Callable[[], TierStats]) -> bool:
        """Emit the interval's row if one is due (``stats`` is called only then); True if one was."""
        now = self.clock()
        if now - self._since < self.interval_s:
            return False
        self._emit(stats(), now)
        return True

    def _emit(self, snapshot: TierStats, now: float) -> None:
        self.emitter.emit(TABLE, interval_row(self.identity, self._last, snapshot, self._since, now))
        self._last, self._since = snapshot, now

    def close(self, stats: TierStats) -> None:
        """The last (partial) interval's row, then the emitter's final flush (blocking: the loop is over)."""
        self._emit(stats, self.clock())
        self.emitter.close()


def open_lake(settings: TierSettings, identity: TierIdentity) -> TierLake | None:
    """The run's ``TierLake`` when ``settings.telemetry_redis_url`` is set, else None (no rows). Nothing
    connects here: the emitter's thread reaches Redis at its first flush."""
    if settings.telemetry_redis_url is None:
        return None
    emitter = Emitter(
        EmitterConfig(
            redis_url=settings.telemetry_redis_url,
            stream_prefix=settings.telemetry_stream_prefix,
            source=f"host-tier-{identity.host}",
        )
    )
    return TierLake(emitter, identity, settings.telemetry_interval_s)
