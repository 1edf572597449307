"""When ``tandem up`` turns the shared cache on by itself: peer KV between colocated nodes (our connector:
split prefill and peer fetch) and a host tier every colocated node shares (``ClusterSpec.peer_kv``,
``ClusterSpec.host_tier``). ``shared_cache_default`` is the rule; ``tandem up --host-tier SIZE|off`` and
``--peer-kv/--no-peer-kv`` override it.

The rule, from measurement on 2-core hosts (SmolLM2-135M, CPU engines):

- Peer KV from two colocated nodes. Split prefill (``router.planning.split_prefill``) computes a cold
  prompt on two idle nodes at once: TTFT 1.83-1.87 s against 3.05-3.25 s alone (cold 1,536-token
  prompts, AMD EPYC host). ``tandem bench fleet --nodes 2`` with it on by default (the defaults arm),
  same host, two runs: TTFT p99 5.51 and 5.60 s against vllm-router ``cache_aware``'s 7.13 and 6.72 s,
  sessions per minute 15.8 and 17.7 against 11.9 and 13.4, client ITL p50 52.4 and 47.9 ms against
  55.1 and 52.3 (before it, the defaults arm's TTFT p99 was 6.48 s against 6.29).
- The host tier from four. At two nodes, ``tandem bench fleet --nodes 2`` (agent sessions over three
  repositories of ~1.5k shared tokens, 1 GiB of KV per node) gave the same hit with the tier (0.821) and
  fewer sessions per minute (16.7 against 20.6 in one run; on the AMD EPYC host, with peer KV in both
  arms, 15.8 against 15.8 and 16.7 against 17.7; on an AMX Xeon host, the two arms alone over six
  rounds, 18.97 against 18.90, the defaults faster in four rounds of six). Cache-aware routing keeps a
  repository's sessions on one node, so its engine already holds the context: ``tandem bench kv-cache
  --nodes 2`` found the tier level with giving the engines its memory (hit 0.903 against 0.904).
- Four colocated nodes: on. ``tandem bench kv-cache`` (four nodes, a 192 MiB tier): hit 0.876 against
  0.579 for the engines alone and 0.737 for the engines given the tier's memory, TTFT p50 0.93 s against
  4.8 s. A repository's sessions spread over several nodes; the tier holds each block once for all of
  them, and a node loads what another computed.

So peer KV from ``PEER_MIN_NODES`` colocated nodes of one model, the tier from ``MIN_NODES`` (four: the count
measured paying; three is not measured, and the tier's cost per engine step is certain where its gain
is not), and a tier only where the host has the memory: 1/``TIER_SHARE`` of the memory available at start, at most
``TIER_MAX`` (the size ``bench fleet`` measured), at least ``TIER_MIN`` (the size ``bench kv-cache``
measured paying), and never more than half of what /dev/shm has free (the tier's file lives there).
Neither for P/D clusters (their nodes already move KV between roles), several served models (the tier
holds one model's layout) or the NIXL connector (it serves no prefixes to peers).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

MIN_NODES = 4
"""Colocated nodes of one model from which the host tier is on by default."""
PEER_MIN_NODES = 2
"""Colocated nodes of one model from which peer KV (split prefill, peer fetch) is on by default."""
TIER_MAX = 2 << 30
TIER_MIN = 192 << 20
TIER_SHARE = 8
"""The default tier takes at most 1/TIER_SHARE of the memory available when the cluster starts."""
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class SharedCache:
    """What ``tandem up`` runs: a host tier of ``host_tier`` (None: none) and peer fetch, and why."""

    host_tier: str | None
    peer_kv: bool
    reason: str


def default_tier_bytes(available: int | None = None, shm_free: int | None = None) -> int:
    """The default tier's size on this host (0: too little memory for one that pays)."""
    available = psutil.virtual_memory().available if available is None else available
    if shm_free is None:
        shm_free = shutil.disk_usage(SHM).free if SHM.is_dir() else 0
    size = min(TIER_MAX, available // TIER_SHARE, shm_free // 2)
    size -= size % (1 << 20)  # whole MiB: a readable size in `tandem up`'s output and the tier's
    return size if size >= TIER_MIN else 0


def shared_cache_default(
    colocated: int,
    *,
    pd_nodes: int = 0,
    models: int = 1,
    connector: str | None = None,
    tier_bytes: int | None = None,
) -> SharedCache:
    """The rule (this module's docstring): peer KV from ``PEER_MIN_NODES`` colocated nodes of one model, the
    host tier too from ``MIN_NODES`` on a host with the memory for it. ``tier_bytes`` stands for
    ``default_tier_bytes()``."""
    if pd_nodes or models > 1 or connector not in (None, "tandem"):
        why = "P/D nodes" if pd_nodes else "several models" if models > 1 else f"the {connector} connector"
        return SharedCache(None, False, f"off ({why})")
    if colocated < PEER_MIN_NODES:
        return SharedCache(None, False, f"off ({colocated} colocated node(s); peer KV from {PEER_MIN_NODES})")
    if colocated < MIN_NODES:
        why = f"{colocated} colocated nodes; the host tier from {MIN_NODES}"
        return SharedCache(None, True, f"peer KV on, host tier off ({why})")
    size = default_tier_bytes() if tier_bytes is None else tier_bytes
    if size < TIER_MIN:
        why = f"under {TIER_MIN >> 20} MiB of memory to spare for a host tier"
        return SharedCache(None, True, f"peer KV on, host tier off ({why})")
    return SharedCache(f"{size >> 20}MiB", True, f"on ({colocated} colocated nodes: {size >> 20} MiB host tier)")
