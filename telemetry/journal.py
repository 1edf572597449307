"""The emitter's journal: events survive the death of the process that emitted them.

An emitter flushes its buffer to Redis every ``flush_interval_s`` (a router every 2 s); a process killed
in between (SIGKILL, the OOM killer, a crash) took those events with it: the chaos benchmark counted
lake rows missing for answers a killed router had already given. With a journal, ``emit`` also appends
the event to a file, and the next process started with the same journal directory (a restarted router:
the launcher gives each child its own directory, kept across restarts) sends what its predecessor had
not.

    emit ──▶ append a frame to the open segment (one write(2) of a few hundred bytes: into the page
             cache, which outlives the process; not fsync'd, so a host crash can still lose it)
    flush ─▶ under the emitter's lock: take the buffer AND close the segment (so the segment holds
             exactly the events taken), open the next; send; delivered ─▶ delete the segment,
             not delivered (Redis down) ─▶ keep it and send it again later
    start ─▶ segments left in the directory by a dead predecessor are sent first, then deleted

Frames are ``<u32 length><msgpack (table, record, time)>``; a torn last frame (a write cut by the
death) is ignored. Each event carries its ``event_id`` from ``emit`` on, so an event sent twice (a
segment delivered, then the process died before deleting it) is written once: the lake writer keeps
one row per event id (``telemetry.lake_writer``). The directory is bounded (``max_bytes``): past it
the oldest kept segments are deleted and their events counted as dropped (``journal_full``).

One journal directory per process: two live processes appending to one directory would send each
other's segments.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
_SUFFIX = ".seg"
Event = tuple[str, Mapping[str, Any], float]
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(tuple[str, dict[str, Any], float]).decode


class Journal:
    """Append-only segments in ``directory``. Not thread-safe: the emitter calls it under its lock."""

    def __init__(self, directory: Path, *, max_bytes: int = 256 << 20) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._seq = itertools.count()
        self.leftovers = sorted(self.directory.glob(f"*{_SUFFIX}"))
        """Segments a previous process left: to send before anything else."""
        self._path, self._fd = self._open()

    def _open(self) -> tuple[Path, int]:
        path = self.directory / f"{time.time_ns():020d}-{os.getpid()}-{next(self._seq):06d}{_SUFFIX}"
        return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def append(self, table: str, record: Mapping[str, Any], t: float) -> None:
        data = _encode((table, record, t))
        os.write(self._fd, _LEN.pack(len(data)) + data)

    def rotate(self) -> Path:
        """Close the open segment and start the next; returns the closed one's path."""
        closed = self._path
        os.close(self._fd)
        self._path, self._fd = self._open()
        return closed

    def release(self, segment: Path) -> None:
        """The segment's events were delivered: delete it."""
        segment.unlink(missing_ok=True)

    def trim(self, keep: list[Path]) -> tuple[list[Path], int]:
        """Delete the oldest of ``keep`` (undelivered segments) while the directory is over
        ``max_bytes``; returns the segments still kept and how many events were deleted."""
        kept = sorted(keep)
        total = sum(p.stat().st_size for p in kept if p.exists())
        lost = 0
        while kept and total > self.max_bytes:
            oldest = kept.pop(0)
            size = oldest.stat().st_size if oldest.exists() else 0
            lost += sum(1 for _ in read_segment(oldest))
            oldest.unlink(missing_ok=True)
            total -= size
        return kept, lost

    def close(self, *, delete_open: bool) -> None:
        os.close(self._fd)
        if delete_open:
            self._path.unlink(missing_ok=True)


def read_segment(path: Path) -> Iterator[Event]:
    """The whole frames of a segment, in order; stops at a torn or unreadable tail."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    pos = 0
    while pos + _LEN.size <= len(data):
        (n,) = _LEN.unpack_from(data, pos)
        end = pos + _LEN.size + n
        if end > len(data):
            log.warning("journal %s: torn last frame ignored (%d bytes)", path.name, len(data) - pos)
            return
        try:
            yield _decode(data[pos + _LEN.size : end])
        except msgspec.DecodeError:
            log.warning("journal %s: unreadable frame at %d; the rest of the segment ignored", path.name, pos)
            return
        pos = end
