"""The host tier's view of an engine's cache on any device: offload and load go through the pinned
staging mirror of ``DeviceKV``, so the tier's arena (its file, its slots, its keys) is today's.

``offload_parts`` stages the blocks device-to-host on the side stream, waits on that copy's event
(the connector's thread, never the engine's stream), and hands back per-block host views for
``TierClient.put_parts``. ``load_parts`` hands back the staging views ``read_scatter`` fills; then
``commit`` queues their host-to-device copy and returns its event: the engine's next forward is
ordered after it by waiting on that event from the engine's stream (``wait_for``), with no host
synchronization. On a CPU cache the views are the cache's own blocks and both stages are no-ops.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kv_transfer.device.backend import Event
from kv_transfer.device.staging import DeviceKV


class TierStaging:
    def __init__(self, kv: DeviceKV) -> None:
        self.kv = kv

    def _views(self, block_id: int) -> list[np.ndarray]:
        return [part[block_id] for part in self.kv.host.layers]

    def offload_parts(self, block_ids: list[int]) -> list[list[np.ndarray]]:
        """Per block, its bytes per part in host memory, copied out of the device first."""
        self.kv.stage_out(block_ids).synchronize()
        return [self._views(b) for b in block_ids]

    def load_parts(self, block_ids: list[int]) -> list[list[np.ndarray]]:
        """Per block, the host views a tier read fills; ``commit`` moves them to the device."""
        return [self._views(b) for b in block_ids]

    def commit(self, block_ids: list[int]) -> Event:
        """Queue the host-to-device copy of loaded blocks; the event completes when they are in place."""
        return self.kv.stage_in(block_ids)


def wait_for(event: Event) -> None:
    """Order the engine's current stream after ``event`` (a GPU-side wait; nothing on CPU)."""
    if isinstance(event, torch.cuda.Event):
        torch.cuda.current_stream().wait_event(event)
    else:
        event.synchronize()


def describe(staging: TierStaging) -> dict[str, Any]:
    return {"parts_per_block": len(staging.kv.host.layers), "part_nbytes": staging.kv.block_part_nbytes}
