"""What the two halves of the host-tier connector (``host_tier.connector``) share: the per-step metadata
the scheduler half hands the worker half (``HostTierMetadata``: blocks to load, to store, evicted), the
router's retention hint as checked at this boundary (``Retain``), and ``TierLink``, the tier client with
its off-while-down timer: a tier that does not answer costs one timeout per ``tier_retry_s``, never one
per lookup, and never a failed request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from contracts.errors import ConfigError
from host_tier.client import TierClient, TierUnavailable

log = logging.getLogger("tandem.kv.host_tier")


class Retain(msgspec.Struct, frozen=True):
    """``kv_transfer_params["tandem_retain"]``, as the router writes it (checked here, at the boundary)."""

    ttl_s: float
    owner: str
    tenant: str = ""


def parse_retain(params: dict[str, Any] | None) -> Retain | None:
    raw = (params or {}).get("tandem_retain")
    if raw is None:
        return None
    try:
        hint = msgspec.convert(raw, Retain)
    except msgspec.ValidationError as exc:
        log.warning("tandem_retain ignored: %s", exc)
        return None
    return hint if 0 < hint.ttl_s <= 86_400 and 0 < len(hint.owner) <= 256 else None


@dataclass
class BlockCopy:
    request_id: str
    block_ids: list[int]
    keys: list[bytes]
    retain: Retain | None = None
    slots: list[int] | None = None
    """A load's tier slots, as the scheduler's lookup found them in the same step: the worker reads them
    without asking again (each read checks the slot still holds its key). None for a store."""


@dataclass
class HostTierMetadata(KVConnectorMetadata):
    loads: list[BlockCopy] = field(default_factory=list)
    stores: list[BlockCopy] = field(default_factory=list)
    evicted: BlockCopy | None = None
    """Blocks the engine evicted this step to reuse them, with the keys they still hold until the step
    writes them: saved to the tier (hot) in ``handle_preemptions``, before any write."""


class TierLink:
    """The tier client, or none when no tier answered at start; off for ``retry_s`` after a failure."""

    def __init__(self, endpoint: str, fingerprint: bytes, *, timeout_s: float, retry_s: float) -> None:
        self.client: TierClient | None = None
        try:
            # 10 s to find the tier at start (it may still be starting); then a short timeout: a lookup
            # runs on the scheduler's thread for every waiting request.
            self.client = TierClient(endpoint, fingerprint, timeout_s=10.0)
            self.client.set_timeout(timeout_s)
        except TierUnavailable as exc:  # no tier answering: serve without it (a miss costs a prefill)
            log.warning("host tier off: %s", exc.message)
        # Any other ConfigError (a tier of another layout) ends the start with its message: a tier the
        # engine could never hit is a configuration error, not a silent 0% hit rate.
        self._retry_s = retry_s
        self._down_until = 0.0

    def up(self) -> TierClient | None:
        """The tier, unless it is off or failed to answer within the last ``retry_s``."""
        if self.client is None or time.monotonic() < self._down_until:
            return None
        return self.client

    def down(self, exc: ConfigError) -> None:
        self._down_until = time.monotonic() + self._retry_s
        log.warning("host tier not answering (%s): off for %.0f s", exc.message, self._retry_s)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
