"""Leases: a prefill node holds a request's KV blocks only under a lease, and every way a transfer can
end releases it, so no block is ever stranded.

A lease is created when the prefill engine finishes a request meant for a remote decode
(``request_finished`` returns delay-free) and lives in the prefill worker beside the block server.
Its blocks go back to the engine's pool the step after the lease reaches a terminal state (the worker
reports the request as ``finished_sending``).

::

                 Pull                      last frame sent / Grant sent
    ┌──────┐ ───────────▶ ┌─────────┐ ──────────────────────────────▶ ┌───────────┐
    │ HELD │              │ SENDING │                                 │ AWAIT_ACK │
    └──────┘ ◀─ ─ ─ ─ ─ ─ └─────────┘                                 └───────────┘
       │    (send error: back to HELD so D may pull again)                  │
       │                                                                    │ Done(ok)      → DONE
       │ Release(reason)   → RELEASED   decode rejected (no room), full     │ Done(not ok)  → FAILED
       │                                local hit, client gone, router      │   (bad checksum, D-side
       │                                gave up on the pair                 │    transfer error)
       │                                                                    │
       └──────── deadline passes in HELD, SENDING or AWAIT_ACK ─────────────┴──▶ EXPIRED
                 (decode died, never pulled, or never acknowledged)

Layer-wise (a lease opened when the prefill starts, served while it computes)::

    ┌─────────┐  Pull(layerwise)   ┌─────────┐  every layer sent (the prefill has ended)
    │ FILLING │ ─────────────────▶ │ SENDING │ ─────────────────────────────────────────▶ AWAIT_ACK
    └─────────┘                    └─────────┘
       │  │ prefill ended, no pull yet → HELD            │
       │  └─ prefill failed or aborted half-way ─────────┴──▶ FAILED (the pull is answered with a Reject)
       │     (RELEASED when nobody was pulling yet)

A lease being filled has no deadline (it lives exactly as long as its prefill, which ends it one way or
the other); its deadline, ``lease_s`` from then, starts when the prefill ends, so a decode node that
died half-way through the layers strands nothing: the lease expires like any other.

Terminal states: DONE, FAILED, RELEASED, EXPIRED. Each frees the prefill node's blocks; the decode
node frees (or recomputes into) its own blocks on its side (``worker.py``): a failed or refused pull
is reported to vLLM as a load error, which either recomputes the prompt locally
(``kv_load_failure_policy=recompute``: the router's "fall back to a local prefill") or fails the
request. If the *prefill* node dies, its blocks die with it; the decode node's pull times out or is
refused at connect, and it takes the same load-error path. A Pull or Release for a lease this table
never had, or already ended, is answered with Reject.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


class LeaseState(enum.StrEnum):
    FILLING = "filling"
    HELD = "held"
    SENDING = "sending"
    AWAIT_ACK = "await_ack"
    DONE = "done"
    FAILED = "failed"
    RELEASED = "released"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = {LeaseState.DONE, LeaseState.FAILED, LeaseState.RELEASED, LeaseState.EXPIRED}

_ALLOWED: dict[LeaseState, set[LeaseState]] = {
    LeaseState.FILLING: {LeaseState.SENDING, LeaseState.HELD, LeaseState.RELEASED, LeaseState.FAILED},
    LeaseState.HELD: {LeaseState.SENDING, LeaseState.RELEASED, LeaseState.EXPIRED},
    LeaseState.SENDING: {
        LeaseState.AWAIT_ACK,
        LeaseState.HELD,
        LeaseState.RELEASED,
        LeaseState.EXPIRED,
        LeaseState.FAILED,
    },
    LeaseState.AWAIT_ACK: {LeaseState.DONE, LeaseState.FAILED, LeaseState.RELEASED, LeaseState.EXPIRED},
}


_RECENT = 10_000


class LeaseError(Exception):
    """A transition the state machine does not allow (a bug, or a message for an ended lease)."""


@dataclass
class Lease:
    transfer_id: str
    block_ids: list[int]
    deadline: float
    """Wall-clock seconds (time.time()): it crosses processes in kv_transfer_params."""
    holder: str
    state: LeaseState = LeaseState.HELD
    reason: str = ""
    created: float = field(default_factory=time.time)
    ended: float | None = None
    layers_ready: int | None = None
    """Layer-wise leases: how many layers of the last chunk the prefill has written (None: the
    lease was made after the prefill, every layer is there)."""
    filled: bool = True
    """Whether the prefill has ended (always, for a lease made after it)."""
    lease_s: float = 0.0
    """Layer-wise leases: the deadline set when the prefill ends, from then."""


class LeaseTable:
    """Thread-safe: the block server's thread moves leases, the engine's worker thread adds them and
    collects the ended ones. ``wait_change`` lets the server sleep until something happens instead
    of polling."""

    def __init__(self, holder: str, on_end: Callable[[], None] | None = None) -> None:
        self.holder = holder
        self._on_end = on_end
        """Called (under the table's lock) whenever a lease ends: wakes an engine waiting for it."""
        self._leases: dict[str, Lease] = {}
        self._ended: list[Lease] = []
        self._recent: dict[str, tuple[LeaseState, float, str]] = {}
        """Terminal state of recently ended leases (bounded), so a late Pull is refused at once."""
        self._cond = threading.Condition()
        self.outcomes: Counter[str] = Counter()

    def add(self, transfer_id: str, block_ids: list[int], deadline: float) -> Lease:
        with self._cond:
            if transfer_id in self._leases:
                raise LeaseError(f"lease {transfer_id} already exists")
            lease = Lease(transfer_id, list(block_ids), deadline, self.holder)
            self._leases[transfer_id] = lease
            self._cond.notify_all()
            return lease

    def open_fill(self, transfer_id: str, lease_s: float) -> Lease:
        """A layer-wise lease, before its prefill has written anything: no blocks known, no deadline."""
        with self._cond:
            if transfer_id in self._leases:
                raise LeaseError(f"lease {transfer_id} already exists")
            lease = Lease(
                transfer_id,
                [],
                math.inf,
                self.holder,
                LeaseState.FILLING,
                layers_ready=0,
                filled=False,
                lease_s=lease_s,
            )
            self._leases[transfer_id] = lease
            self._cond.notify_all()
            return lease

    def fill(self, transfer_id: str, layers: int, block_ids: list[int] | None = None, *, done: bool = False) -> Lease:
        """The prefill has written ``layers`` layers (of its last chunk) into ``block_ids``; ``done``: it
        has ended, so the deadline starts and, if nobody pulls yet, the lease is simply HELD."""
        with self._cond:
            lease = self._leases.get(transfer_id)
            if lease is None or lease.filled:
                raise LeaseError(f"no lease {transfer_id} being filled")
            if block_ids is not None:
                lease.block_ids = list(block_ids)
            lease.layers_ready = max(lease.layers_ready or 0, layers)
            if done:
                lease.filled = True
                lease.deadline = time.time() + lease.lease_s
                if lease.state is LeaseState.FILLING:
                    lease.state = LeaseState.HELD
            self._cond.notify_all()
            return lease

    def get(self, transfer_id: str) -> Lease | None:
        with self._cond:
            return self._leases.get(transfer_id)

    def move(self, transfer_id: str, to: LeaseState, reason: str = "") -> Lease:
        with self._cond:
            lease = self._leases.get(transfer_id)
            if lease is None:
                raise LeaseError(f"no live lease {transfer_id}")
            if to not in _ALLOWED[lease.state]:
                raise LeaseError(f"lease {transfer_id}: {lease.state} → {to} is not a transition")
            lease.state, lease.reason = to, reason or lease.reason
            if to.terminal:
                self._end(lease)
            self._cond.notify_all()
            return lease

    def _end(self, lease: Lease) -> None:
        lease.ended = time.time()
        del self._leases[lease.transfer_id]
        self._ended.append(lease)
        self.outcomes[lease.state.value] += 1
        self._recent[lease.transfer_id] = (lease.state, lease.ended, lease.reason)
        if len(self._recent) > _RECENT:
            del self._recent[next(iter(self._recent))]
        if self._on_end is not None:
            self._on_end()

    def ended_state(self, transfer_id: str) -> LeaseState | None:
        with self._cond:
            ended = self._recent.get(transfer_id)
            return ended[0] if ended else None

    def ended_info(self, transfer_id: str) -> tuple[LeaseState, float, str] | None:
        """(terminal state, wall-clock end, reason) of a recently ended lease."""
        with self._cond:
            return self._recent.get(transfer_id)

    def expire(self, now: float | None = None) -> list[Lease]:
        """End every live lease whose deadline has passed; returns them."""
        now = time.time() if now is None else now
        with self._cond:
            gone = [lease for lease in self._leases.values() if lease.deadline <= now]
            for lease in gone:
                lease.state, lease.reason = LeaseState.EXPIRED, f"deadline passed in {lease.state}"
                self._end(lease)
            if gone:
                self._cond.notify_all()
            return gone

    def take_ended(self) -> list[Lease]:
        """Leases that reached a terminal state since the last call (their blocks may now be freed)."""
        with self._cond:
            out, self._ended = self._ended, []
            return out

    def has_ended(self) -> bool:
        """Whether ``take_ended`` has something to return."""
        with self._cond:
            return bool(self._ended)

    def next_deadline(self) -> float | None:
        """The earliest finite deadline (leases being filled have none)."""
        with self._cond:
            return min((lease.deadline for lease in self._leases.values() if lease.deadline < math.inf), default=None)

    def wait_for(self, transfer_id: str, timeout: float) -> Lease | None:
        """Wait until a lease with this id exists (a Pull may overtake the step that creates it)."""
        end = time.monotonic() + timeout
        with self._cond:
            while transfer_id not in self._leases:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._leases[transfer_id]

    def __len__(self) -> int:
        with self._cond:
            return len(self._leases)

    def sending(self) -> int:
        """Leases whose transfer has started (SENDING or AWAIT_ACK)."""
        with self._cond:
            return sum(
                1 for lease in self._leases.values() if lease.state in (LeaseState.SENDING, LeaseState.AWAIT_ACK)
            )

    def leased_blocks(self) -> int:
        with self._cond:
            return sum(len(lease.block_ids) for lease in self._leases.values())
