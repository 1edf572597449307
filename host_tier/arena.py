"""The host tier's memory: one shared-memory file of fixed-size slots, one KV block per slot.

Layout (little-endian), in ``/dev/shm`` by default so it is RAM and outlives every process that maps it:

    file header (4096 B): magic "TNDMTIER", version u32, slot_bytes u64, n_slots u64, fingerprint 32 B
    slot i at 4096 + i * stride, stride = 64 + slot_bytes rounded up to 64:
        gen u64 | key 32 B | checksum u64 | length u32 | pad | data (slot_bytes)

``fingerprint`` names what a block's bytes mean (model, dtype, block size, layer layout; see
``host_tier.layout``): a file made for another fingerprint is never read as this one, it is replaced.

Who writes what. Only the tier server (``server.py``) hands out slots, so two writers never share a
slot; the writer is a client (an engine's worker) copying straight into the mapping, with no copy
through the server. Readers never ask the server: a slot is read under a **seqlock**:

    writer:  gen += 1 (odd: being written) -> data, key, checksum, length -> gen += 1 (even: valid)
    reader:  g1 = gen (even, not 0) -> key == wanted -> copy data -> checksum(copy) == checksum
             -> gen == g1

A slot the server reuses while a reader copies it changes ``gen`` or fails the checksum, so a reader
gets either the block it asked for, whole and verified, or ``None`` (recompute), never another
block's bytes: the failure Dynamo #15079 reports (a tier serving another request's KV) cannot pass
both the key and the checksum test. x86 stores are not reordered with other stores (TSO), and every
field access here goes through the interpreter, so no extra fence is needed on this platform.

Trust. The file holds tenants' prompts in KV form, and a client maps whatever it names, so a file
someone else planted (the name follows from a public model config) must never be mapped: every open is
``O_NOFOLLOW`` (no symlink to another file), and ``fstat`` on the open descriptor (not the name, which
could be swapped in between) must show a regular file owned by this user with no group or other
access. Anything else raises ``TierFileRefused`` naming the path, its owner and mode: the server does
not start on it and a client does not map it. The operator removes it (``tandem tier clear``).

Restart: ``scan()`` rebuilds the index from the slot headers (every even, non-zero ``gen`` whose data
matches its checksum), so the tier survives its own server's restart as well as the engines'.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from contracts.errors import ConfigError

MAGIC = b"TNDMTIER"
VERSION = 1
FILE_HEADER = 4096
SLOT_HEADER = 64
KEY_BYTES = 32


class TierFileRefused(ConfigError):
    """A tier file this process must not map: not a regular file, another owner, or open to others."""


def _check_private(fd: int, path: Path) -> int:
    """The size of the file open on ``fd`` if it is ours alone; raises ``TierFileRefused`` otherwise."""
    st = os.fstat(fd)
    problems = []
    if not stat.S_ISREG(st.st_mode):
        problems.append("not a regular file")
    if st.st_uid != os.geteuid():
        problems.append(f"owned by uid {st.st_uid}, not {os.geteuid()}")
    if st.st_mode & 0o077:
        problems.append(f"mode {stat.S_IMODE(st.st_mode):04o} lets others in (0600 expected)")
    if problems:
        raise TierFileRefused(f"host tier file {path} refused: {'; '.join(problems)}; remove it and restart the tier")
    return st.st_size


_FILE_HDR = struct.Struct("<8sIQQ32s")
_GEN = struct.Struct("<Q")
_META = struct.Struct("<32sQI")  # key, checksum, length: right after gen
_META_OFF = 8


def checksum(data: memoryview | bytes | np.ndarray) -> int:
    """xxh3-64 of a block's bytes: about 20 GB/s on one core, far above any copy it guards."""
    buf = data.data if isinstance(data, np.ndarray) else data  # ndarray's buffer (must be contiguous)
    return int(xxhash.xxh3_64_intdigest(buf))


@dataclass(frozen=True)
class SlotRecord:
    """A valid slot found by ``scan``."""

    slot: int
    key: bytes
    length: int


class Arena:
    """A mapping of the tier file. The server creates it (``create``); clients ``open`` it."""

    def __init__(self, path: Path, mm: mmap.mmap, slot_bytes: int, n_slots: int, fingerprint: bytes) -> None:
        self.path = path
        self._mm = mm
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.fingerprint = fingerprint
        self.stride = -(-(SLOT_HEADER + slot_bytes) // 64) * 64
        self._buf = np.frombuffer(mm, dtype=np.uint8)

    # -- lifecycle ---------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, slot_bytes: int, n_slots: int, fingerprint: bytes) -> Arena:
        """Map ``path`` for this geometry and fingerprint: an existing file that matches is kept with its
        blocks (a restart); one that does not is replaced (its blocks mean something else)."""
        if len(fingerprint) != KEY_BYTES:
            raise ValueError("fingerprint must be 32 bytes")
        existing = cls._try_open(path)
        if existing is not None:
            if (existing.slot_bytes, existing.n_slots, existing.fingerprint) == (slot_bytes, n_slots, fingerprint):
                return existing
            existing.close()
            path.unlink()
        stride = -(-(SLOT_HEADER + slot_bytes) // 64) * 64
        size = FILE_HEADER + stride * n_slots
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        # 0600: the blocks are tenants' prompts in KV form; only this user's processes may map them.
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # left by a crashed start of a process with this pid
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "wb") as f:
            # Allocated up front: the configured bound is taken at start (a host short of memory fails
            # here, not mid-offload), and no write pays a first-touch fault (0.8 against 5.9 GB/s here).
            # Zero-filled: gen 0 marks every slot empty.
            os.posix_fallocate(f.fileno(), 0, size)
            f.write(_FILE_HDR.pack(MAGIC, VERSION, slot_bytes, n_slots, fingerprint))
        os.replace(tmp, path)  # a half-written header is never visible under the real name
        arena = cls._try_open(path)
        assert arena is not None
        return arena

    @classmethod
    def open(cls, path: Path) -> Arena:
        arena = cls._try_open(path)
        if arena is None:
            raise FileNotFoundError(f"no host tier at {path}")
        return arena

    @classmethod
    def _try_open(cls, path: Path) -> Arena | None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:  # ELOOP: the name is a symbolic link
            raise TierFileRefused(f"host tier file {path} refused: {e.strerror}; remove it and restart the tier") from e
        try:
            size = _check_private(fd, path)
            if size < FILE_HEADER:
                return None
            # MAP_POPULATE: map every page now, so no copy into or out of the tier pays a page fault
            # (writes ran at 1 GB/s with faults, against 8 GB/s for reads of mapped pages).
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version, slot_bytes, n_slots, fp = _FILE_HDR.unpack_from(mm, 0)
        stride = -(-(SLOT_HEADER + slot_bytes) // 64) * 64
        if magic != MAGIC or version != VERSION or size < FILE_HEADER + stride * n_slots:
            mm.close()
            return None
        return cls(path, mm, slot_bytes, n_slots, fp)

    def close(self) -> None:
        del self._buf
        self._mm.close()

    # -- slots -------------------------------------------------------------------------------------------
    def _off(self, slot: int) -> int:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} out of range (0..{self.n_slots - 1})")
        return FILE_HEADER + slot * self.stride

    def gen(self, slot: int) -> int:
        return int(_GEN.unpack_from(self._mm, self._off(slot))[0])

    def data(self, slot: int) -> np.ndarray:
        """The slot's data bytes, as a writable view into the mapping (no copy)."""
        off = self._off(slot) + SLOT_HEADER
        return self._buf[off : off + self.slot_bytes]

    def begin_write(self, slot: int) -> int:
        """Open a slot for writing; returns the odd ``gen`` this write holds (``end_write`` checks it)."""
        off = self._off(slot)
        g = int(_GEN.unpack_from(self._mm, off)[0])
        mine = g + 1 if g % 2 == 0 else g + 2  # odd: readers keep out
        _GEN.pack_into(self._mm, off, mine)
        return mine

    def end_write(self, slot: int, key: bytes, length: int, mine: int) -> bool:
        """Seal a written slot (its checksum over the first ``length`` bytes, then an even ``gen``), only
        if no one opened it since ``begin_write`` returned ``mine``: a writer the server gave up on (its
        slot reclaimed and handed on) never seals a block over bytes the next writer changed."""
        off = self._off(slot)
        digest = checksum(self.data(slot)[:length])
        if int(_GEN.unpack_from(self._mm, off)[0]) != mine:
            return False
        _META.pack_into(self._mm, off + _META_OFF, key, digest, length)
        _GEN.pack_into(self._mm, off, mine + 1)
        return True

    def write(self, slot: int, key: bytes, payload: memoryview | bytes | np.ndarray) -> bool:
        """Write a whole block from one buffer (engines write theirs in parts: ``write_gather``)."""
        src = payload.view(np.uint8) if isinstance(payload, np.ndarray) else np.frombuffer(payload, dtype=np.uint8)
        return self.write_gather(slot, key, [src.reshape(-1)])

    def write_gather(self, slot: int, key: bytes, parts: list[np.ndarray]) -> bool:
        """Write a block from its parts (one per layer, in the engine's memory), one after another.
        False: the slot was taken from this writer meanwhile, nothing was sealed."""
        mine = self.begin_write(slot)
        data = self.data(slot)
        pos = 0
        for part in parts:
            n = part.size
            if pos + n > self.slot_bytes:
                raise ValueError(f"block parts of {pos + n}+ bytes > slot of {self.slot_bytes}")
            data[pos : pos + n] = part.reshape(-1)
            pos += n
        return self.end_write(slot, key, pos, mine)

    def read_scatter(self, slot: int, key: bytes, parts: list[np.ndarray]) -> bool:
        """Copy a held block straight into its destinations (one per layer), no staging copy: the
        checksum is taken over the slot before the copy, and the seqlock's second ``gen`` read after
        it, so bytes a writer changed meanwhile are caught by one test or the other."""
        off = self._off(slot)
        g1 = int(_GEN.unpack_from(self._mm, off)[0])
        if g1 == 0 or g1 % 2:
            return False
        k, digest, length = _META.unpack_from(self._mm, off + _META_OFF)
        if k != key or length != sum(p.size for p in parts):
            return False
        data = self.data(slot)
        if checksum(data[:length]) != digest:
            return False
        pos = 0
        for part in parts:
            part.reshape(-1)[:] = data[pos : pos + part.size]
            pos += part.size
        return int(_GEN.unpack_from(self._mm, off)[0]) == g1

    def invalidate(self, slot: int) -> None:
        """Mark a slot empty (``gen`` odd then zeroed key): a reader mid-copy fails its ``gen`` test."""
        off = self._off(slot)
        self.begin_write(slot)
        _META.pack_into(self._mm, off + _META_OFF, b"\0" * KEY_BYTES, 0, 0)

    def read_into(self, slot: int, key: bytes, out: np.ndarray) -> bool:
        """Copy the slot's block into ``out`` (uint8, at least ``length`` bytes) if it still holds ``key``,
        whole and matching its checksum; False otherwise (the caller recomputes)."""
        off = self._off(slot)
        g1 = int(_GEN.unpack_from(self._mm, off)[0])
        if g1 == 0 or g1 % 2:
            return False
        k, digest, length = _META.unpack_from(self._mm, off + _META_OFF)
        if k != key or length > out.size:
            return False
        dst = out[:length]
        dst[:] = self.data(slot)[:length]
        if checksum(dst) != digest:
            return False
        return int(_GEN.unpack_from(self._mm, off)[0]) == g1

    def read(self, slot: int, key: bytes) -> bytes | None:
        out = np.empty(self.slot_bytes, dtype=np.uint8)
        off = self._off(slot)
        length = int(_META.unpack_from(self._mm, off + _META_OFF)[2])
        return out[:length].tobytes() if self.read_into(slot, key, out) else None

    def scan(self) -> Iterator[SlotRecord]:
        """Every slot that holds a whole, verified block (after a server restart)."""
        for slot in range(self.n_slots):
            off = self._off(slot)
            g = int(_GEN.unpack_from(self._mm, off)[0])
            if g == 0 or g % 2:
                continue
            key, digest, length = _META.unpack_from(self._mm, off + _META_OFF)
            if length == 0 or length > self.slot_bytes:
                continue
            if checksum(self.data(slot)[:length]) == digest:
                yield SlotRecord(slot, key, length)
