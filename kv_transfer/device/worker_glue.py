"""What the connector's worker half does differently when its cache is in device memory, in one
place, so that the worker's hooks stay one line each: nothing is served before its staging copy is
complete, nothing pulled is reported before it is in the device cache, and the engine's thread
never waits for a copy (it queues it, and each later step hands on what has completed).

- ``offer``: a whole lease's blocks are staged device-to-host; the lease reaches the block server
  once that copy's event has completed (``poll``, every step).
- ``layer_written``: a layer-wise prefill's layer is staged behind the engine's work on it; the
  block server hears ``fill`` for it once the copy is complete, layers always in order.
- ``pulled``: a finished pull's blocks are staged host-to-device; the request is reported received
  (``received``) once that copy is complete.
On a host cache (``DeviceKV.on_host``) every event is complete when made: the calls pass straight
through, the CPU path's behaviour unchanged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from kv_transfer.device.backend import Event
from kv_transfer.device.staging import DeviceKV


class Server(Protocol):
    def offer(self, transfer_id: str, block_ids: list[int], deadline: float) -> None: ...

    def fill(
        self, transfer_id: str, layers: int, block_ids: list[int] | None = None, *, done: bool = False
    ) -> None: ...


@dataclass
class _Pending:
    event: Event
    action: tuple[Any, ...]


class DeviceWorkerGlue:
    def __init__(self, kv: DeviceKV) -> None:
        self.kv = kv
        self._queue: deque[_Pending] = deque()
        """Offers and fills, in the order the engine made them (a fill never overtakes its layer's
        predecessor, nor an offer the fills before it)."""
        self._loads: list[tuple[Event, str]] = []

    def offer(self, server: Server, transfer_id: str, block_ids: list[int], deadline: float) -> None:
        self._queue.append(_Pending(self.kv.stage_out(block_ids), ("offer", transfer_id, block_ids, deadline)))
        self.poll(server)

    def layer_written(self, server: Server, transfer_id: str, layer: int, block_ids: list[int], done: bool) -> None:
        """The engine has queued its writes of ``layer`` (0-based) into the lease's blocks."""
        parts = (layer + 1) * self.kv.map.per_layer
        event = self.kv.stage_out(block_ids, [layer])
        self._queue.append(_Pending(event, ("fill", transfer_id, parts, block_ids if layer == 0 else None, done)))
        self.poll(server)

    def poll(self, server: Server) -> int:
        """Hand the server every staged offer and fill whose copy has completed, in order; how many."""
        n = 0
        while self._queue and self._queue[0].event.query():
            kind, *args = self._queue.popleft().action
            if kind == "offer":
                server.offer(*args)
            else:
                tid, parts, block_ids, done = args
                server.fill(tid, parts, block_ids, done=done)
            n += 1
        return n

    def pulled(self, request_id: str, local_block_ids: list[int]) -> None:
        self._loads.append((self.kv.stage_in(local_block_ids), request_id))

    def received(self) -> set[str]:
        """Requests whose pulled blocks are now in the device cache."""
        done = {rid for ev, rid in self._loads if ev.query()}
        self._loads = [(ev, rid) for ev, rid in self._loads if rid not in done]
        return done

    @property
    def in_flight(self) -> int:
        return len(self._queue) + len(self._loads)
