"""Split prefills' synchronous loads: each attention layer waits for its share of the prefix.

A split prefill (``contracts.transfer.TransferParams.split``) computes one prompt on two nodes at once: a
peer computes the prefix (a layer-wise prefill leg) while this node computes the rest, in one engine
step that starts before the prefix exists. vLLM counts the prefix as loaded synchronously, so it
schedules the rest at once, and before each attention layer it asks the connector to wait for that
layer's KV (``wait_for_layer_load``). The two nodes then go through the layers together, this one a
layer behind: the prompt takes about the time of its larger half plus a layer, not the time of both
halves one after the other, as when the prefix is loaded whole before anything is computed.

    start(step)        open(request)  one entry per split pull that begins in this step; entries of
                                      earlier steps are dropped (their layers were all waited for)
    pull thread        layers(n)      n leading layers written here; ended(ok) when the pull ends
    forward, layer l   wait(l)        returns once every open entry has written layer l, or ended;
                                      the block ids of entries that failed or stalled (no layer for
                                      ``stall_s``) are returned once, for vLLM to recompute
                                      (``kv_load_failure_policy``)

The wait blocks the engine's forward pass, everything else in the step included: a router splits
only onto a node with nothing else running (``router.planning``), and ``stall_s`` bounds the harm of a
peer that never starts its half.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class _Entry:
    request_id: str
    block_ids: list[int]
    gate: LayerGate
    written: int = 0
    done: bool = False
    """The pull ended (``ok``: every layer in place)."""
    ok: bool = False
    reported: bool = False
    """Its failure was handed to the caller of ``wait`` already."""
    progress_at: float = field(default_factory=time.monotonic)

    # -- decode_nodes.puller.PullWatch, called from the pull's thread ---------------------------------
    def layers(self, written: int) -> None:
        with self.gate.cond:
            self.written = max(self.written, written)
            self.progress_at = time.monotonic()
            self.gate.cond.notify_all()

    def ended(self, ok: bool) -> None:
        with self.gate.cond:
            self.done, self.ok = True, ok
            self.gate.cond.notify_all()


class LayerGate:
    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.cond = threading.Condition()
        self._open: dict[str, _Entry] = {}

    def begin_step(self) -> None:
        """A new step: the entries of earlier ones are done with (their step waited on every layer)."""
        with self.cond:
            self._open.clear()

    def open(self, request_id: str, block_ids: list[int]) -> _Entry:
        """An entry for a split pull that starts in this step; pass it to the pull as its watch."""
        entry = _Entry(request_id, list(block_ids), self)
        with self.cond:
            self._open[request_id] = entry
        return entry

    def __len__(self) -> int:
        return len(self._open)

    def wait(self, layer: int) -> list[_Entry]:
        """Block until every open entry has written ``layer`` (0-based) or ended; the entries that failed
        or stalled meanwhile, each returned once (their blocks are load errors)."""
        failed: list[_Entry] = []
        with self.cond:
            while True:
                now = time.monotonic()
                waiting = False
                timeout = self.stall_s
                for entry in self._open.values():
                    if entry.reported or (entry.done and entry.ok) or entry.written > layer:
                        continue
                    stalled = now - entry.progress_at >= self.stall_s
                    if entry.done or stalled:
                        entry.reported = True
                        failed.append(entry)
                        continue
                    waiting = True
                    timeout = min(timeout, entry.progress_at + self.stall_s - now)
                if not waiting:
                    return failed
                self.cond.wait(max(timeout, 0.001))
