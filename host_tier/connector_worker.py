"""The worker half of the host-tier connector (``host_tier.connector``): the copies between the engine's
KV cache and the tier's slots. Loads run before the step's forward, each block checked by the tier's
seqlock and checksum (``host_tier.arena``); a block that fails is reported as a load error, so vLLM
recomputes from it, and the tier forgets it. A load asks the tier's process nothing: it reads the
slots the scheduler's lookup found in the same step and tells the tier it holds the blocks now with a
notice it does not wait for (``TierClient.demote``). Beside busy processes on a 2-core host each
round trip to the tier waited 4-9 ms for a core, two of them on every remote hit. Stores copy a
finished request's blocks out (Reserve -> copy -> Commit) and pin those the router marked for
retention; evicted blocks are saved hot in ``handle_preemptions``, before anything writes them.
"""

from __future__ import annotations

import logging

import numpy as np

from contracts.errors import ConfigError
from host_tier.connector_meta import BlockCopy, HostTierMetadata, TierLink
from kv_transfer.layout import KVLayout

log = logging.getLogger("tandem.kv.host_tier")


class TierWorker:
    def __init__(self, link: TierLink, num_blocks: int) -> None:
        self._link = link
        self._num_blocks = num_blocks
        self._kv: KVLayout | None = None
        self._stored: set[str] = set()
        self._load_errors: set[int] = set()
        self.loaded_blocks = 0
        self.stored_blocks = 0

    def register(self, kv: KVLayout) -> None:
        self._kv = kv

    def _parts(self, block_id: int) -> list[np.ndarray]:
        assert self._kv is not None
        return [layer[block_id] for layer in self._kv.layers]

    def handle_preemptions(self, meta: HostTierMetadata) -> None:
        if meta.evicted is not None:
            self._store(meta.evicted, cold=False)

    def start_load(self, meta: HostTierMetadata) -> None:
        for copy in meta.stores:
            self._store(copy, cold=True)  # the engine keeps them cached: the tier's copy is the spare
            self._stored.add(copy.request_id)  # always: vLLM frees the blocks only once it is reported
        for copy in meta.loads:
            self._load(copy)

    def _load(self, copy: BlockCopy) -> None:
        """Fill the claimed blocks, or report them as load errors: a claimed block left unfilled would
        be computed on from whatever the cache held, so every path ends in one or the other."""
        tier = self._link.up()
        found = (copy.slots or []) if tier is not None and self._kv is not None else []
        loaded = 0
        for i, block_id in enumerate(copy.block_ids):
            ok = (
                i < len(found)
                and tier is not None
                and tier.arena.read_scatter(found[i], copy.keys[i], self._parts(block_id))
            )
            if not ok:
                # This block and the rest are recomputed (vLLM recomputes from the first failed block).
                self._load_errors.update(copy.block_ids[i:])
                if tier is not None and i < len(found):
                    try:
                        tier.forget([copy.keys[i]])
                    except ConfigError as exc:
                        self._link.down(exc)
                break
            loaded += 1
        self.loaded_blocks += loaded
        if loaded and tier is not None:
            tier.demote(copy.keys[:loaded])  # this engine holds them now: the tier's are the spares

    def _store(self, copy: BlockCopy, *, cold: bool) -> None:
        tier = self._link.up()
        if tier is None or self._kv is None:
            return
        try:
            self.stored_blocks += tier.put_parts(copy.keys, [self._parts(b) for b in copy.block_ids], cold=cold)
            if copy.retain is not None:
                r = copy.retain
                tier.pin(copy.keys, r.ttl_s, r.owner, r.tenant)
        except ConfigError as exc:
            self._link.down(exc)
        except ValueError as exc:  # a block larger than the tier's slots: another layout slipped through
            log.warning("host tier offload skipped: %s", exc)

    def finished_sending(self) -> set[str]:
        done, self._stored = self._stored, set()
        return done

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
