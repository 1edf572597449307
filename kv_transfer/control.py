"""The router's one call into the KV path: release a prefill node's lease when the router gives up on
the pair before the decode node could (the decode leg failed to open, the client left between the
legs). The decode node releases leases itself in every other case; releasing twice is harmless."""

from __future__ import annotations

import logging
from typing import Any

import zmq
import zmq.asyncio

from kv_transfer import wire

log = logging.getLogger("tandem.kv.control")

_ctx: zmq.asyncio.Context | None = None


def is_tandem_params(params: dict[str, Any] | None) -> bool:
    return bool(params) and "transfer_id" in params and "remote_endpoints" in params  # type: ignore[operator]


async def release_lease(params: dict[str, Any], reason: str, *, timeout_s: float = 2.0) -> bool:
    """Ask the prefill node named in ``params`` (its kv_transfer_params) to free the lease now.
    Returns whether it acknowledged; a dead node has nothing left to free, and the lease deadline is
    the backstop either way."""
    global _ctx
    if not is_tandem_params(params):
        return False
    _ctx = _ctx or zmq.asyncio.Context()
    sock = _ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(params["remote_endpoints"]["tcp"])
        await sock.send(wire.encode(wire.Release(params["transfer_id"], reason)))
        if await sock.poll(int(timeout_s * 1000)):
            return isinstance(wire.decode(await sock.recv()), wire.Ack)
        log.warning("prefill node did not acknowledge the release of %s", params["transfer_id"])
        return False
    finally:
        sock.close(0)
