"""Which cores each process of a cluster computes on: the P/D halves, the colocated nodes' slices
(``assign_cores``), and how many router replicas a host of this many cores runs (``default_routers``).
The routers and the lake writer are not placed here."""

from __future__ import annotations

import os

from contracts.registry import Role

SMALL_HOST_CORES = 2
"""Hosts of this many cores or fewer run one router replica by default (``default_routers``)."""


def default_routers() -> int:
    """One router replica on a host of ``SMALL_HOST_CORES`` or fewer, two elsewhere. On a small host every
    core computes for an engine, and a second replica is one more process taking turns on them (its
    registry refresh, its KV-event subscriptions, its share of the streams) and about 0.7 GB. Measured
    on a 2-core host with warmed replicas (``tandem bench fleet --arm tandem --rounds 1 --routers R``,
    two one-core nodes, runs alternating 2, 1, 2, 1): one replica 21.5 and 23.3 sessions per minute,
    TTFT p99 2.1 and 1.9 s; two replicas 19.4 and 21.3, TTFT p99 3.1 and 2.0 s. A replica restarts
    within seconds when it dies (``supervise``); on larger hosts the second one keeps serving meanwhile."""
    return 1 if len(_cores()) <= SMALL_HOST_CORES else 2


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _span(chosen: list[int]) -> str:
    return f"{chosen[0]}-{chosen[-1]}" if len(chosen) > 1 else str(chosen[0])


def assign_cores(role: Role, has_pd: bool, slot: int = 0, slots: int = 1) -> str:
    """P and D get disjoint halves of the machine's cores, so a prefill burst never steals decode's
    core. Colocated nodes without a P/D pair split all cores between them (``slot`` of ``slots``;
    one node alone gets all of them); beside a P/D pair a colocated node shares decode's half: OpenMP
    threads spread over cores that other engines also use stall each other at every barrier
    (measured: 40 tokens took 58 s instead of 2 s on two shared cores)."""
    cores = _cores()
    if not has_pd and role is Role.BOTH:
        if slots <= 1 or len(cores) < 2:
            return _span(cores)
        if slots >= len(cores):
            return str(cores[slot % len(cores)])
        share = len(cores) // slots
        return _span(cores[slot * share : (slot + 1) * share])
    if len(cores) < 2:
        return _span(cores)
    half = len(cores) // 2
    return _span(cores[:half] if role is Role.PREFILL else cores[half:])
