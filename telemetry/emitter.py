"""The slow-path emitter: the fast path hands it a dict and moves on.

    emit(table, record)          O(1): one deque append (or one counter increment when dropping);
                                 no I/O, no lock the flusher holds, never raises, never blocks
        │
        ▼  bounded deque (capacity events; full -> drop, reason buffer_full)
    flusher thread               every flush_interval_s, or as soon as batch_size events wait:
                                 group by table -> Arrow RecordBatch -> Arrow IPC stream bytes
        │                        (lz4) -> one pipelined round trip of XADDs
        ▼
    Redis Stream <prefix>:<table>   one stream per table; each entry is one batch:
                                    v (schema version), n (rows), src (source), a (IPC bytes)

Why a daemon thread and not an asyncio task: ``emit`` is called from async handlers and from plain
threads alike (node agents, vLLM callbacks); a thread needs no running event loop, cannot be starved by
a busy loop, and keeps the blocking Redis client and the Arrow building off the loop, so a slow or dead
Redis never touches request latency. pyarrow releases the GIL in its kernels. In an asyncio app
(FastAPI) build one Emitter in the lifespan and ``await emitter.aclose()`` at shutdown.

Drops, each counted in ``tandem_telemetry_dropped_events_total{table,reason}``:
    buffer_full        the deque holds ``capacity`` events (Redis slow or down, or a burst)
    redis_unavailable  the XADD round trip failed (connection refused, timeout); the batch is dropped
                       and the flusher backs off (0.1 s doubling to max_backoff_s) while the deque
                       absorbs what it can. A timeout after Redis applied the XADD can count events
                       that did arrive: the counter is an upper bound.
    stream_full        the stream already holds ``stream_maxlen`` entries: the lake writer deletes
                       entries it has written, so the length is its backlog; a dead writer must not
                       fill Redis. The check and the XADD are one Lua script, so the newest batch is
                       refused (and counted exactly) instead of MAXLEN silently trimming older,
                       unread batches. ``MAXLEN ~`` stays on the XADD as a second guard.
    invalid            unknown table, or a record whose values do not fit the schema
    closed             emit() after close()

Without a journal the emitter never retries a batch, so each event id reaches the stream at most once;
the lake writer's de-duplication handles its own retries (see lake_writer). With one (``journal_dir``,
``telemetry.journal``), each event is also appended to a file as it is emitted, with its event id, and
segments that did not reach Redis (Redis down, or the process killed before its flush) are sent again,
by this process or the next one with the directory: at least once, and once per id in the lake.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import redis
from redis.exceptions import NoScriptError, RedisError

from contracts.config import DEFAULT_REDIS_URL
from telemetry.batches import batch_to_ipc, build_batch
from telemetry.journal import Journal, read_segment
from telemetry.metrics import METRICS, TandemMetrics
from telemetry.schemas import SCHEMA_VERSION, SCHEMAS

log = logging.getLogger(__name__)

DEFAULT_STREAM_PREFIX = "tandem:telemetry"

# KEYS[1] = stream; ARGV[1] = max entries; ARGV[2..] = field, value pairs. Returns the id or nil.
_XADD_BOUNDED = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return false end
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 2))
"""


def stream_key(prefix: str, table: str) -> str:
    """Name of the Redis Stream carrying ``table``."""
    return f"{prefix}:{table}"


def default_source() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class EmitterConfig:
    redis_url: str = DEFAULT_REDIS_URL
    """Redis holding the telemetry streams."""
    stream_prefix: str = DEFAULT_STREAM_PREFIX
    """Streams are ``<stream_prefix>:<table>``; the lake writer must use the same prefix."""
    source: str = ""
    """Written in every row's ``source`` column; empty means ``<hostname>-<pid>``."""
    capacity: int = 100_000
    """Events the buffer holds before emit() drops (about 2 KB each: ~200 MB worst case)."""
    batch_size: int = 2_000
    """Flush as soon as this many events wait; also the most rows in one stream entry."""
    flush_interval_s: float = 0.5
    """Flush at least this often when anything waits."""
    stream_maxlen: int = 1_000
    """Most entries (batches) per stream; beyond it new batches are dropped (stream_full). An entry of
    2,000 request rows is ~0.4 MB (lz4 IPC), so the default bounds a stream near 400 MB."""
    socket_timeout_s: float = 1.0
    """Redis connect and read timeout of the flusher."""
    max_backoff_s: float = 5.0
    """Longest pause between Redis attempts while Redis is down."""
    journal_dir: Path | None = None
    """Also append every event to files here (``telemetry.journal``), so that events of a process that
    dies before flushing are sent by the next one started with the same directory; None: no journal.
    One directory per process."""
    journal_max_bytes: int = 256 << 20
    """Most bytes of undelivered journal kept while Redis is down; beyond it the oldest are dropped."""


class Emitter:
    """One per process. ``emit`` from any thread or coroutine; ``close`` (or ``aclose``) flushes."""

    def __init__(
        self,
        config: EmitterConfig | None = None,
        *,
        metrics: TandemMetrics | None = None,
        start: bool = True,
    ) -> None:
        """``start=False`` leaves the flusher stopped (tests; or call ``start()`` later)."""
        self.config = cfg = config or EmitterConfig()
        if cfg.capacity < 1 or cfg.batch_size < 1 or cfg.stream_maxlen < 1:
            raise ValueError("capacity, batch_size and stream_maxlen must be positive")
        self._metrics = metrics or METRICS
        self._source = cfg.source or default_source()
        # Event ids: a random 64-bit process prefix and a counter (cheaper than uuid4 per event).
        self._id_prefix = uuid.uuid4().hex[:16]
        self._id_counter = itertools.count()
        self._queue: collections.deque[tuple[str, Mapping[str, Any], float]] = collections.deque()
        self._capacity = cfg.capacity
        self._batch_size = cfg.batch_size
        self._wake = threading.Event()
        self._arrived = threading.Event()
        """Set by ``emit`` while clear: lets an idle flusher sleep until there is something to send."""
        self._flush_lock = threading.Lock()
        self._closed = False
        self._stopping = False
        self._backoff = 0.0
        self._retry_at = 0.0
        self._drop_children: dict[tuple[str, str], Any] = {}
        self._warned_keys: set[tuple[str, str]] = set()
        self._redis = redis.Redis.from_url(
            cfg.redis_url,
            socket_timeout=cfg.socket_timeout_s,
            socket_connect_timeout=cfg.socket_timeout_s,
            health_check_interval=0,
        )
        self._xadd = self._redis.register_script(_XADD_BOUNDED)
        self._thread: threading.Thread | None = None
        self._journal: Journal | None = None
        self._journal_lock = threading.Lock()
        self._undelivered: list[Path] = []
        """Journal segments whose events did not reach Redis (or left by a dead predecessor): sent
        again, oldest first, before anything newer."""
        if cfg.journal_dir is not None:
            self._journal = Journal(cfg.journal_dir, max_bytes=cfg.journal_max_bytes)
            self._undelivered = list(self._journal.leftovers)
            if self._undelivered:
                log.info("telemetry journal: %d segments left by a previous process", len(self._undelivered))
        if start:
            self.start()

    # ---- fast path -------------------------------------------------------------------------------

    def emit(self, table: str, record: Mapping[str, Any]) -> bool:
        """Queue one event; True if queued, False if dropped (and counted). The record is kept by
        reference until flushed: do not mutate it afterwards."""
        if self._closed:
            self._drop(table if table in SCHEMAS else "unknown", "closed")
            return False
        if table not in SCHEMAS:
            self._drop("unknown", "invalid")
            return False
        q = self._queue
        if len(q) >= self._capacity:
            self._drop(table, "buffer_full")
            return False
        if self._journal is not None:
            return self._emit_journaled(table, record)
        q.append((table, record, time.time()))
        if not self._arrived.is_set():
            self._arrived.set()
        if len(q) >= self._batch_size and not self._wake.is_set():
            self._wake.set()
        return True

    def _emit_journaled(self, table: str, record: Mapping[str, Any]) -> bool:
        # The id is fixed now, so that an event sent again from the journal is the same event.
        if not record.get("event_id"):
            record = {**record, "event_id": self._new_id()}
        t = time.time()
        with self._journal_lock:  # with flush's take-and-rotate: each event in the segment taken with it
            assert self._journal is not None
            try:
                self._journal.append(table, record, t)
            except (OSError, TypeError, ValueError) as exc:  # disk full, or a value msgpack cannot hold
                log.warning("telemetry journal: %s event not journaled: %s", table, exc)
            self._queue.append((table, record, t))
        if not self._arrived.is_set():
            self._arrived.set()
        if len(self._queue) >= self._batch_size and not self._wake.is_set():
            self._wake.set()
        return True

    def queue_length(self) -> int:
        return len(self._queue)

    def _drop(self, table: str, reason: str, n: int = 1) -> None:
        child = self._drop_children.get((table, reason))
        if child is None:
            child = self._metrics.dropped_events.labels(table, reason)
            self._drop_children[(table, reason)] = child
        child.inc(n)

    # ---- flusher ---------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="tandem-telemetry-flusher", daemon=True)
        self._thread.start()

    def _idle(self) -> bool:
        return not self._queue and not self._undelivered

    def _run(self) -> None:
        interval = self.config.flush_interval_s
        while not self._stopping:
            self._arrived.clear()  # before the check: an event emitted after it sets it again
            if self._idle():
                # Nothing to send: sleep until the first event instead of waking every interval. On a
                # CPU host every wake-up of any process can stall an engine's forward pass.
                self._arrived.wait()
                if self._stopping:
                    break
            self._wake.wait(timeout=interval)  # the batching window from the first event
            self._wake.clear()
            if self._stopping:
                break
            if time.monotonic() < self._retry_at:
                self._metrics.telemetry_queue_length.set(len(self._queue))
                continue
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the flusher must survive anything; the loss is counted
                log.exception("telemetry flusher: unexpected error")

    def flush(self) -> int:
        """Send everything queued now (blocking; not for the fast path). Returns events sent."""
        if self._journal is not None:
            return self._flush_journaled()
        sent = 0
        with self._flush_lock:
            pending = len(self._queue)
            while pending > 0:
                n = min(pending, self._batch_size)
                pending -= n
                items = []
                try:
                    for _ in range(n):
                        items.append(self._queue.popleft())
                except IndexError:
                    pass
                if not items:
                    break
                sent += self._send(items)
            self._metrics.telemetry_queue_length.set(len(self._queue))
        return sent

    def _flush_journaled(self) -> int:
        assert self._journal is not None
        with self._flush_lock:
            sent, delivered = self._resend_undelivered()
            with self._journal_lock:
                items = list(self._queue)
                self._queue.clear()
                segment = self._journal.rotate()
            if not items:
                self._journal.release(segment)
                return sent
            if delivered:  # nothing older waits: send in order
                ok = True
                for i in range(0, len(items), self._batch_size):
                    n, batch_ok = self._deliver(items[i : i + self._batch_size])
                    sent, ok = sent + n, ok and batch_ok
            else:
                ok = False
                for table, _, _ in items:
                    self._drop(table, "redis_unavailable")
            if ok:
                self._journal.release(segment)
            else:
                self._undelivered.append(segment)
                self._undelivered, lost = self._journal.trim(self._undelivered)
                if lost:
                    self._drop("unknown", "journal_full", lost)
            self._metrics.telemetry_queue_length.set(len(self._queue))
        return sent

    def _resend_undelivered(self) -> tuple[int, bool]:
        """Send the kept segments, oldest first; stop at the first that fails. Returns events sent and
        whether none is left."""
        assert self._journal is not None
        sent = 0
        while self._undelivered:
            if time.monotonic() < self._retry_at:
                return sent, False
            segment = self._undelivered[0]
            events = list(read_segment(segment))
            ok = True
            for i in range(0, len(events), self._batch_size):
                n, batch_ok = self._deliver(events[i : i + self._batch_size])
                sent, ok = sent + n, ok and batch_ok
                if not ok:
                    break
            if not ok:
                return sent, False
            self._journal.release(segment)
            self._undelivered.pop(0)
        return sent, True

    def _deliver(self, items: list[tuple[str, Mapping[str, Any], float]]) -> tuple[int, bool]:
        """``_send``, and whether Redis took the batch (refused as stream_full counts as taken: the
        writer is far behind, and sending it again would not help)."""
        retry_before = self._retry_at
        n = self._send(items)
        return n, not (self._retry_at > retry_before or (self._retry_at and time.monotonic() < self._retry_at))

    def _send(self, items: list[tuple[str, Mapping[str, Any], float]]) -> int:
        by_table: dict[str, tuple[list[Mapping[str, Any]], list[float]]] = {}
        for table, rec, t in items:
            recs, times = by_table.setdefault(table, ([], []))
            recs.append(rec)
            times.append(t)
        payloads: list[tuple[str, int, bytes]] = []
        for table, (recs, times) in by_table.items():
            batch = self._build(table, recs, times)
            if batch is not None and batch.num_rows:
                payloads.append((table, batch.num_rows, batch_to_ipc(batch)))
        if not payloads:
            return 0
        if time.monotonic() < self._retry_at:
            for table, nrows, _ in payloads:
                self._drop(table, "redis_unavailable", nrows)
            return 0
        cfg = self.config
        try:
            try:
                results = self._xadd_all(payloads)
            except NoScriptError:  # a restarted (or flushed) Redis: load the script, send once more
                self._redis.script_load(_XADD_BOUNDED)
                results = self._xadd_all(payloads)
        except RedisError as exc:
            self._backoff = min(cfg.max_backoff_s, max(0.1, self._backoff * 2))
            self._retry_at = time.monotonic() + self._backoff
            log.warning("telemetry: Redis unavailable (%s); dropping %d events", exc, len(items))
            for table, nrows, _ in payloads:
                self._drop(table, "redis_unavailable", nrows)
            return 0
        self._backoff = 0.0
        self._retry_at = 0.0
        sent = 0
        for (table, nrows, _), res in zip(payloads, results, strict=True):
            if res is None:
                self._drop(table, "stream_full", nrows)
            else:
                self._metrics.sent_events.labels(table).inc(nrows)
                sent += nrows
        return sent

    def _new_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_counter):016x}"

    def _build(self, table: str, recs: list[Mapping[str, Any]], times: list[float]) -> pa.RecordBatch | None:
        names = set(SCHEMAS[table].names)
        for rec in recs:
            if not names.issuperset(rec):
                for key in set(rec) - names:
                    if (table, key) not in self._warned_keys:
                        self._warned_keys.add((table, key))
                        log.warning("telemetry: %s has no field %r; ignored", table, key)
        try:
            return build_batch(table, recs, times, self._source, self._new_id)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            pass
        # Some row does not fit: keep the rows that do, count the others.
        good = []
        for rec, t in zip(recs, times, strict=True):
            try:
                good.append(build_batch(table, [rec], [t], self._source, self._new_id))
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                self._drop(table, "invalid")
        if not good:
            return None
        return pa.Table.from_batches(good).combine_chunks().to_batches()[0]

    # ---- shutdown --------------------------------------------------------------------------------

    def _xadd_all(self, payloads: list[tuple[str, int, bytes]]) -> list[Any]:
        """One pipelined round trip of the bounded XADD script. By its hash, not as a redis-py Script: a
        pipeline holding Scripts first asks Redis whether they exist, a second round trip per flush."""
        cfg = self.config
        pipe = self._redis.pipeline(transaction=False)
        for table, nrows, data in payloads:
            key = stream_key(cfg.stream_prefix, table)
            args = [cfg.stream_maxlen, "v", SCHEMA_VERSION, "n", nrows, "src", self._source, "a", data]
            pipe.evalsha(self._xadd.sha, 1, key, *args)
        return pipe.execute()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop accepting events, flush what is queued (one attempt), stop the flusher."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self._wake.set()
        self._arrived.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self._retry_at = 0.0
        self.flush()
        left = len(self._queue)
        if left:
            self._queue.clear()
            self._drop("unknown", "closed", left)
        if self._journal is not None:
            # What was not delivered stays in the directory for the next process to send.
            self._journal.close(delete_open=True)
        self._redis.close()

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """``close`` from a coroutine, without blocking the event loop."""
        await asyncio.to_thread(self.close, timeout_s)

    def __enter__(self) -> Emitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
