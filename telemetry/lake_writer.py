"""The lake writer: Redis Streams -> Parquet, at least once, without duplicates.

Layout: ``<lake>/<table>/date=YYYY-MM-DD/hour=HH/part-<part_id>.parquet`` (partition from each row's
``event_time``, UTC). Every file is written to a temporary name (``.*.tmp``, which no reader globs),
fsynced, renamed into place, and the directory fsynced; only then are the stream entries acknowledged.

Exactly-once output from at-least-once delivery, across crashes and restarts
--------------------------------------------------------------------------------
A *part* is a set of stream entries (each entry is one emitter batch) written together. Before any
file is written, the writer records the part's *intent* in Redis, atomically (one Lua script):

    <stream>:lake:<group>:parts   hash  part_id -> entry ids of the part
    <stream>:lake:<group>:owner   hash  entry id -> part_id      (an entry belongs to one part)

The part id is derived from the entry ids (``<first>_<last>``), and the files of a part are a pure
function of its entries, so writing a part again produces the same file names with the same rows and
the rename simply replaces them. After the files are in place, one MULTI transaction acknowledges the
entries (XACK), deletes them from the stream (XDEL: the stream length is then the backlog, which the
emitter bounds), and deletes the intent. Hence, whenever the writer meets an entry again (its own
pending list after a restart, or entries it took over from a dead consumer with XAUTOCLAIM):

    entry has no owner            never written: it joins a new part
    entry's part has an intent    the part may be half written: redo that whole part, with exactly the
                                  entries its intent lists (re-read with XRANGE in one transaction with
                                  the intent check), then commit; same names, so nothing is duplicated
    intent gone                   committed by someone else meanwhile: nothing to do

A crash at any point therefore loses nothing (entries stay pending until the commit) and duplicates
nothing (a redo overwrites the same files). Two writers redoing one part concurrently write identical
files. Rows carry ``event_id``; within a part duplicates are dropped (the emitter never re-sends, so
there are none in practice), and compaction de-duplicates a whole partition on ``event_id``.

Entries it cannot write: the dead-letter stream
------------------------------------------------
An entry whose payload is not an Arrow IPC stream of its table (corrupt bytes, a stranger's XADD
without the ``a`` field, rows without ``event_id`` / ``event_time``) would otherwise fail its part on
every attempt and stop the writer. Each entry is decoded on its own; one that fails is left out of
the part's files and moved, with the reason, to ``<stream>:dead`` (capped at ``dead_letter_maxlen``)
*in the same transaction* that acknowledges the part, so it is dead-lettered exactly when the part
commits, once, and the rest of the part is written as usual. Counted on
``tandem_lake_dead_letter_entries_total{table}``. Because decoding is a pure function of the entry, a
redo of the part makes the same decision.

A lake it cannot write: back off, resume by itself
---------------------------------------------------
A file-system error while writing a part (ENOSPC, EDQUOT, EIO) raises ``LakeUnwritable``; ``run``
logs it ("disk full"), sets ``tandem_lake_unwritable`` to 1 and retries with a doubling delay capped at
``unwritable_backoff_max_s``. Nothing is lost meanwhile: the part's intent is recorded and its entries
stay pending, so the retry (a recovery pass) redoes exactly that part once space returns, and the
emitters bound the stream's growth (dropping and counting, never blocking serving).

Compaction and the file primitives (atomic Parquet writes, partitions, decoding) live in
``telemetry.lake_files``.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import RedisError

from contracts.config import DEFAULT_REDIS_URL
from contracts.errors import LakeUnwritable, StoreError
from telemetry.emitter import DEFAULT_STREAM_PREFIX, stream_key
from telemetry.lake_files import (
    CompactResult,
    DeadLetter,
    Part,
    WriteStats,
    compact_tables,
    decode_entries,
    dedupe,
    entry_payload,
    partition_dir,
    split_by_hour,
    write_parquet_atomic,
)
from telemetry.metrics import METRICS, TandemMetrics
from telemetry.schemas import SCHEMA_VERSION, SCHEMAS, TABLE_NAMES

log = logging.getLogger(__name__)

# KEYS[1] = owner hash, KEYS[2] = parts hash; ARGV[1] = part id, ARGV[2] = intent, ARGV[3..] = entry ids.
# Returns the entry ids already owned by another part (then nothing is written), or an empty list.
_CLAIM_PART = """
local taken = {}
for i = 3, #ARGV do
  local o = redis.call('HGET', KEYS[1], ARGV[i])
  if o and o ~= ARGV[1] then table.insert(taken, ARGV[i]) end
end
if #taken > 0 then return taken end
for i = 3, #ARGV do redis.call('HSET', KEYS[1], ARGV[i], ARGV[1]) end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return taken
"""


@dataclass(frozen=True, slots=True)
class WriterConfig:
    lake: Path
    """Root folder of the lake."""
    redis_url: str = DEFAULT_REDIS_URL
    """Redis holding the telemetry streams."""
    stream_prefix: str = DEFAULT_STREAM_PREFIX
    """Same prefix as the emitters'."""
    group: str = "lake"
    """Consumer group; every writer of one lake uses the same group."""
    consumer: str = field(default_factory=socket.gethostname)
    """This writer's name in the group; keep it stable across restarts so that a restarted writer
    picks up its own pending entries at once (others' are taken over after claim_idle_s)."""
    tables: tuple[str, ...] = TABLE_NAMES
    """Tables (streams) to consume."""
    batch_entries: int = 64
    """Most stream entries per XREADGROUP per stream; one part (one Parquet file per hour) each."""
    block_ms: int = 1000
    """How long a read waits for new entries."""
    claim_idle_s: float = 60.0
    """Take over entries another consumer has held unacknowledged for this long (XAUTOCLAIM)."""
    compression: str = "zstd"
    """Parquet compression codec."""
    delete_acked: bool = True
    """XDEL entries once written, so the stream length is the backlog (the emitter bounds it)."""
    dead_letter_maxlen: int = 10_000
    """Most entries kept in each ``<stream>:dead`` (approximate trim, oldest first)."""
    unwritable_backoff_max_s: float = 30.0
    """Longest wait between attempts while the lake cannot be written (disk full)."""


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class LakeWriter:
    """Consumes the telemetry streams of one consumer group into the lake. Not thread-safe: one
    writer per thread or process; run several processes with distinct ``consumer`` names to scale."""

    def __init__(self, config: WriterConfig, *, metrics: TandemMetrics | None = None) -> None:
        self.config = config
        self._metrics = metrics or METRICS
        self._redis = redis.Redis.from_url(config.redis_url, socket_timeout=30, socket_connect_timeout=5)
        self._claim = self._redis.register_script(_CLAIM_PART)
        self._streams = {t: stream_key(config.stream_prefix, t) for t in config.tables}
        for t in config.tables:
            if t not in SCHEMAS:
                raise ValueError(f"unknown telemetry table {t!r}")
        self._groups_ready = False

    # ---- keys ------------------------------------------------------------------------------------

    def _owner_key(self, table: str) -> str:
        return f"{self._streams[table]}:lake:{self.config.group}:owner"

    def _parts_key(self, table: str) -> str:
        return f"{self._streams[table]}:lake:{self.config.group}:parts"

    def _redis_call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except RedisError as exc:
            raise StoreError(f"lake writer: Redis failed during {what}: {exc}") from exc

    def ensure_groups(self) -> None:
        """Create the consumer group on every stream (from the stream's start) if missing."""
        if self._groups_ready:
            return
        for stream in self._streams.values():
            try:
                self._redis.xgroup_create(stream, self.config.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise StoreError(f"lake writer: cannot create group on {stream}: {exc}") from exc
            except RedisError as exc:
                raise StoreError(f"lake writer: cannot create group on {stream}: {exc}") from exc
        self._groups_ready = True

    # ---- reading ---------------------------------------------------------------------------------

    def read_new(self, block_ms: int | None = None) -> dict[str, list[tuple[str, bytes | None]]]:
        """Entries never delivered to the group (XREADGROUP >), per table; blocks up to block_ms
        (None: the configured block_ms; 0: do not block)."""
        self.ensure_groups()
        block = self.config.block_ms if block_ms is None else block_ms
        resp = self._redis_call(
            "XREADGROUP",
            lambda: self._redis.xreadgroup(
                self.config.group,
                self.config.consumer,
                {s: ">" for s in self._streams.values()},
                count=self.config.batch_entries,
                block=block if block > 0 else None,
            ),
        )
        return self._by_table(resp)

    def _by_table(self, resp: Any) -> dict[str, list[tuple[str, bytes | None]]]:
        by_stream = {v: k for k, v in self._streams.items()}
        out: dict[str, list[tuple[str, bytes | None]]] = {}
        for stream, entries in resp or []:
            table = by_stream[_s(stream)]
            out.setdefault(table, []).extend((_s(eid), entry_payload(fields)) for eid, fields in entries)
        return out

    def read_pending(self) -> dict[str, list[tuple[str, bytes | None]]]:
        """This consumer's own pending entries (delivered before a crash), then entries idle longer
        than claim_idle_s in other consumers' pending lists (XAUTOCLAIM), per table."""
        self.ensure_groups()
        cfg = self.config
        out: dict[str, list[tuple[str, bytes | None]]] = {}
        for table, stream in self._streams.items():
            got: dict[str, bytes | None] = {}
            start = "0"
            while True:
                resp = self._redis_call(
                    "XREADGROUP 0",
                    lambda start=start, stream=stream: self._redis.xreadgroup(
                        cfg.group, cfg.consumer, {stream: start}, count=cfg.batch_entries * 4
                    ),
                )
                entries = resp[0][1] if resp else []
                if not entries:
                    break
                for eid, fields in entries:
                    got[_s(eid)] = entry_payload(fields)
                start = _s(entries[-1][0])
            cursor = "0-0"
            while True:
                resp = self._redis_call(
                    "XAUTOCLAIM",
                    lambda cursor=cursor, stream=stream: self._redis.xautoclaim(
                        stream,
                        cfg.group,
                        cfg.consumer,
                        min_idle_time=int(cfg.claim_idle_s * 1000),
                        start_id=cursor,
                        count=cfg.batch_entries * 4,
                    ),
                )
                cursor = _s(resp[0])
                for eid, fields in resp[1]:
                    got[_s(eid)] = entry_payload(fields)
                for eid in resp[2] if len(resp) > 2 else []:
                    got[_s(eid)] = None
                if cursor == "0-0":
                    break
            if got:
                out[table] = sorted(got.items(), key=lambda kv: _id_key(kv[0]))
        return out

    # ---- planning: which parts to write ---------------------------------------------------------

    def plan(self, table: str, entries: list[tuple[str, bytes | None]]) -> list[Part]:
        """Turn delivered entries into parts: entries of an open intent redo that part, the others
        form a new part whose intent is recorded now (before any file is written)."""
        if not entries:
            return []
        ids = [eid for eid, _ in entries]
        owners = self._redis_call("HMGET owner", lambda: self._redis.hmget(self._owner_key(table), ids))
        parts: list[Part] = []
        seen: set[str] = set()
        fresh: list[tuple[str, bytes | None]] = []
        for (eid, data), owner in zip(entries, owners, strict=True):
            if owner is None:
                fresh.append((eid, data))
            elif _s(owner) not in seen:
                seen.add(_s(owner))
                part = self._load_part(table, _s(owner))
                if part is not None:
                    parts.append(part)
        while fresh:
            part_id = f"{fresh[0][0]}_{fresh[-1][0]}"
            fids = [eid for eid, _ in fresh]
            intent = json.dumps({"entries": fids, "consumer": self.config.consumer, "at": time.time()})
            taken = self._redis_call(
                "claim part",
                lambda part_id=part_id, fids=fids, intent=intent: self._claim(
                    keys=[self._owner_key(table), self._parts_key(table)], args=[part_id, intent, *fids]
                ),
            )
            if not taken:
                parts.append(Part(table, part_id, fids, [d for _, d in fresh]))
                break
            # Another writer recorded some of these entries in its part meanwhile: it (or whoever
            # later claims them) writes them; we keep the rest.
            taken_set = {_s(t) for t in taken}
            fresh = [(eid, d) for eid, d in fresh if eid not in taken_set]
        return parts

    def _load_part(self, table: str, part_id: str) -> Part | None:
        """An open intent's entries, read in one transaction with the intent check; None if the part
        was committed meanwhile."""
        raw = self._redis_call("HGET parts", lambda: self._redis.hget(self._parts_key(table), part_id))
        if raw is None:
            return None
        ids = json.loads(raw)["entries"]
        stream = self._streams[table]

        def snapshot() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)
            pipe.hexists(self._parts_key(table), part_id)
            for eid in ids:
                pipe.xrange(stream, eid, eid)
            return pipe.execute()

        res = self._redis_call("XRANGE part", snapshot)
        if not res[0]:
            return None
        data = [entry_payload(r[0][1]) if r else None for r in res[1:]]
        return Part(table, part_id, ids, data, redo=True)

    # ---- writing and committing -----------------------------------------------------------------

    def write_part(self, part: Part) -> tuple[list[Path], int]:
        """Write the part's files (one per event hour); returns them and the rows written. Idempotent:
        the same part always produces the same names and rows. Entries that do not decode are left out
        and listed in ``part.dead`` for ``commit``. A file-system failure raises ``LakeUnwritable``."""

        def bad(i: int, payload: bytes, exc: Exception) -> None:
            part.dead.append(DeadLetter(part.entry_ids[i], payload, f"{type(exc).__name__}: {exc}"[:500]))

        part.dead = []
        rows = dedupe(decode_entries(part.table, part.data, on_bad=bad))
        meta = dict(SCHEMAS[part.table].metadata or {})
        meta[b"tandem.part_id"] = part.part_id.encode()
        meta[b"tandem.entries"] = ",".join(part.entry_ids).encode()
        meta[b"tandem.schema_version"] = str(SCHEMA_VERSION).encode()
        paths = []
        for hour, rows_h in split_by_hour(rows):
            final = partition_dir(self.config.lake, part.table, hour) / f"part-{part.part_id}.parquet"
            try:
                write_parquet_atomic(rows_h.replace_schema_metadata(meta), final, self.config.compression)
            except OSError as exc:
                full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                raise LakeUnwritable(
                    f"lake writer: cannot write {final}: {'disk full: ' if full else ''}{exc}", disk_full=full
                ) from exc
            paths.append(final)
        return paths, rows.num_rows

    def commit(self, part: Part) -> None:
        """Acknowledge (and delete) the part's entries, move its undecodable ones to the dead-letter
        stream and drop its intent, atomically."""
        stream = self._streams[part.table]

        def tx() -> None:
            pipe = self._redis.pipeline(transaction=True)
            for d in part.dead:
                pipe.xadd(
                    f"{stream}:dead",
                    {
                        "a": d.payload,
                        "entry_id": d.entry_id,
                        "table": part.table,
                        "reason": d.reason,
                        "at": str(time.time()),
                    },
                    maxlen=self.config.dead_letter_maxlen,
                    approximate=True,
                )
            pipe.xack(stream, self.config.group, *part.entry_ids)
            if self.config.delete_acked:
                pipe.xdel(stream, *part.entry_ids)
            pipe.hdel(self._owner_key(part.table), *part.entry_ids)
            pipe.hdel(self._parts_key(part.table), part.part_id)
            pipe.execute()

        self._redis_call("commit", tx)

    def process(self, table: str, entries: list[tuple[str, bytes | None]]) -> WriteStats:
        stats = WriteStats()
        for part in self.plan(table, entries):
            lost = sum(1 for d in part.data if d is None)
            if lost:
                log.warning("lake writer: %d entries of part %s are gone from the stream", lost, part.part_id)
            paths, rows = self.write_part(part)
            self.commit(part)
            if part.dead:
                log.error(
                    "lake writer: %d entries of %s moved to %s:dead (first: %s %s)",
                    len(part.dead),
                    table,
                    self._streams[table],
                    part.dead[0].entry_id,
                    part.dead[0].reason,
                )
                self._metrics.lake_dead_letter_entries.labels(table).inc(len(part.dead))
            stats.dead_letters += len(part.dead)
            stats.entries += len(part.entry_ids)
            stats.rows += rows
            stats.files += len(paths)
            stats.redone_parts += int(part.redo)
            stats.lost_entries += lost
            self._metrics.lake_written_events.labels(table).inc(rows)
        return stats

    # ---- loops ----------------------------------------------------------------------------------

    def recover(self) -> WriteStats:
        """Finish whatever this consumer (or a dead one) left pending."""
        stats = WriteStats()
        for table, entries in self.read_pending().items():
            for i in range(0, len(entries), self.config.batch_entries):
                stats.add(self.process(table, entries[i : i + self.config.batch_entries]))
        return stats

    def run_once(self, block_ms: int | None = None) -> WriteStats:
        """Read one batch of new entries per stream and write them."""
        stats = WriteStats()
        for table, entries in self.read_new(block_ms).items():
            stats.add(self.process(table, entries))
        return stats

    def drain(self) -> WriteStats:
        """Recover, then write until no new entry is waiting (for tests, benchmarks, ``--once``)."""
        stats = self.recover()
        while True:
            s = self.run_once(block_ms=0)
            stats.add(s)
            if s.entries == 0:
                return stats

    def run(
        self,
        stop: threading.Event,
        *,
        recover_every_s: float = 30.0,
        on_batch: Callable[[WriteStats], None] | None = None,
    ) -> WriteStats:
        """Consume until ``stop`` is set. Redis failures are logged and retried with backoff; after
        one, pending entries are recovered first."""
        total = WriteStats()
        backoff = 0.0
        next_recover = 0.0
        unwritable = False
        while not stop.is_set():
            try:
                if time.monotonic() >= next_recover:
                    s = self.recover()
                    next_recover = time.monotonic() + recover_every_s
                else:
                    s = self.run_once()
                backoff = 0.0
                if unwritable:
                    unwritable = False
                    self._metrics.lake_unwritable.set(0)
                    log.warning("lake writer: the lake at %s is writable again; resuming", self.config.lake)
            except LakeUnwritable as exc:
                # Entries stay pending under their part's intent; the recovery pass redoes that part.
                unwritable = True
                self._metrics.lake_unwritable.set(1)
                backoff = min(self.config.unwritable_backoff_max_s, max(0.5, backoff * 2))
                log.error(
                    "%s; %s, backing off %.1f s (nothing is lost: the entries stay pending)",
                    exc,
                    "disk full" if exc.disk_full else "lake unwritable",
                    backoff,
                )
                next_recover = 0.0
                stop.wait(backoff)
                continue
            except StoreError as exc:
                backoff = min(10.0, max(0.2, backoff * 2))
                log.warning("%s; retrying in %.1fs", exc, backoff)
                next_recover = 0.0
                stop.wait(backoff)
                continue
            total.add(s)
            if on_batch is not None and s.entries:
                on_batch(s)
        return total

    # ---- compaction -----------------------------------------------------------------------------

    def open_part_ids(self, table: str) -> set[str]:
        keys = self._redis_call("HKEYS parts", lambda: self._redis.hkeys(self._parts_key(table)))
        return {_s(k) for k in keys}

    def compact(
        self, *, min_age_s: float = 600.0, progress: Callable[[Path], None] | None = None
    ) -> list[CompactResult]:
        """Compact every partition of this writer's tables (see ``telemetry.lake_files.compact_partition``)."""
        cfg = self.config
        return compact_tables(cfg.lake, cfg.tables, self.open_part_ids, min_age_s, cfg.compression, progress)

    def close(self) -> None:
        self._redis.close()


def _id_key(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)
