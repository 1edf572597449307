"""Transfer statistics, collected in the engine's worker by the server and puller threads. vLLM ships
snapshots to its API-server process every step (``get_kv_connector_stats``), where ``prom.py`` turns
them into ``tandem_kv_*`` metrics on the engine's own ``/metrics``. No vLLM import here: the transports
run (and are tested) without an engine."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

LISTS = ("recv_seconds", "recv_bytes", "send_seconds", "send_blocks")
COUNTS = ("recv_blocks", "failed_transfers", "rejected", "recv_failed", "unauthenticated", "peer_refused")
GAUGES = ("leases_active", "leased_blocks", "leases_sending", "pulls_active")


@dataclass
class TransferStats:
    """Worker-side accumulator (thread-safe: the server and puller threads record into it)."""

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    recv_seconds: list[float] = field(default_factory=list)
    recv_bytes: list[int] = field(default_factory=list)
    send_seconds: list[float] = field(default_factory=list)
    send_blocks: list[int] = field(default_factory=list)
    recv_blocks: int = 0
    failed_transfers: int = 0
    recv_failed: int = 0
    rejected: int = 0
    unauthenticated: int = 0
    """Control frames refused at the block server for a bad or missing MAC."""
    peer_refused: int = 0
    """Pulls refused because the peer could not prove what the transport needs (``shm``: same host,
    same uid, the pid it names)."""
    lease_outcomes: dict[str, int] = field(default_factory=dict)

    def record_recv(self, nbytes: int, nblocks: int, seconds: float) -> None:
        with self.lock:
            self.recv_seconds.append(seconds)
            self.recv_bytes.append(nbytes)
            self.recv_blocks += nblocks

    def record_send(self, block_ids: list[int], seconds: float) -> None:
        with self.lock:
            self.send_seconds.append(seconds)
            self.send_blocks.append(len(block_ids))

    def record_outcomes(self, outcomes: list[str]) -> None:
        with self.lock:
            for o in outcomes:
                self.lease_outcomes[o] = self.lease_outcomes.get(o, 0) + 1

    def snapshot(
        self, leases_active: int, leased_blocks: int, leases_sending: int, pulls_active: int
    ) -> dict[str, Any]:
        """Take what accumulated since the last call (vLLM sums successive snapshots itself)."""
        with self.lock:
            data: dict[str, Any] = {k: getattr(self, k) for k in LISTS}
            data.update({k: getattr(self, k) for k in COUNTS})
            data["lease_outcomes"] = self.lease_outcomes
            data.update(
                leases_active=leases_active,
                leased_blocks=leased_blocks,
                leases_sending=leases_sending,
                pulls_active=pulls_active,
            )
            for k in LISTS:
                setattr(self, k, [])
            for k in COUNTS:
                setattr(self, k, 0)
            self.lease_outcomes = {}
        return data
