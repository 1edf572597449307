"""Noticing that a client went away, with one task per request.

A request must be cancelled everywhere once its client leaves: while it is planned and opened (node
slots, the prefill leg) and while its answer streams. The ASGI server tells of a disconnect only
through ``receive()`` returning ``http.disconnect``, so something must be waiting there. Racing each
step against a fresh watcher (two tasks and an ``asyncio.wait`` per step), then Starlette's streaming
response doing the same again with an anyio task group, cost several tasks per request: on a CPU host
each is CPU taken from the engines (issue 11).

Here one watcher task waits on ``receive()`` for the request's whole life and, when the client goes,
cancels the task serving the request, wherever it is. That task tells this cancellation from any
other (server shutdown) by ``disconnected``::

    arm ─▶ (client gone) ─▶ disconnected = True, owner.cancel()
     │
     └▶ disarm (the last byte of the answer is about to go) ─▶ a later http.disconnect is ignored

Disarming matters: once the response is complete, uvicorn answers every ``receive()`` with
``http.disconnect``, which must not cancel the request while it records itself.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive


class DisconnectWatch:
    """Cancels the current task when the client disconnects (see the module docstring)."""

    __slots__ = ("disconnected", "_armed", "_owner", "_watcher")

    def __init__(self, receive: Receive) -> None:
        self.disconnected = False
        """The client went away while armed (and the owner task was cancelled for it)."""
        self._armed = True
        owner = asyncio.current_task()
        assert owner is not None, "a DisconnectWatch belongs to the task serving the request"
        self._owner = owner
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # more request body nobody reads: the body was read before the watch started
        if self._armed:
            self.disconnected = True
            self._owner.cancel()

    def disarm(self) -> None:
        """From now on a disconnect cancels nothing (the answer's end is being sent)."""
        self._armed = False

    def close(self) -> None:
        self._armed = False
        self._watcher.cancel()

    def absorb(self) -> bool:
        """In the owner's ``except CancelledError``: True (and the cancellation undone) when it was this
        watch's doing, so the caller treats it as the client leaving; False for any other cancel."""
        if not self.disconnected:
            return False
        self._owner.uncancel()
        return True
