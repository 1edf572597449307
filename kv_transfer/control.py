"""The router's two calls into the KV path, both to the prefill node named in a request's
kv_transfer_params, both off the fast path:

- ``release_lease``: free the lease when the router gives up on the pair before the decode node
  could (the decode leg failed to open, the client left between the legs). The decode node releases
  leases itself in every other case; releasing twice is harmless.
- ``lease_report``: how the transfer went (bytes, start, end), for the lake record of a streamed
  answer (vLLM hands the decode side's own report back only with non-streamed ones).

Both are signed with the cluster secret and their answers verified (``wire.Codec``; where the secret
comes from: ``auth.py``, read from this process's environment once). A node on a non-loopback address
needs an explicit secret here too: without one, these calls log an error and report nothing."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from contracts.errors import ConfigError, PeerUnauthenticated, TandemError, UpstreamError, VersionMismatch
from contracts.secret import is_loopback, load_cluster_secret
from contracts.transfer import TransferParams, TransferReport, is_transfer_params
from kv_transfer import wire

log = logging.getLogger("tandem.kv.control")

_ctx: zmq.asyncio.Context | None = None


def is_tandem_params(params: dict[str, Any] | None) -> bool:
    return is_transfer_params(params)


def _params(params: dict[str, Any], what: str) -> TransferParams | None:
    """The typed params, or None (logged as an error naming both versions) when they are not ours."""
    try:
        return TransferParams.from_dict(params)
    except TandemError as exc:
        log.error("%s of transfer %s not sent: %s", what, params.get("transfer_id"), exc.message)
        return None


@cache
def _codec(loopback: bool) -> wire.Codec:
    return wire.Codec(load_cluster_secret(loopback_only=loopback))


async def _ask(params: TransferParams, msg: wire.Message, timeout_s: float) -> wire.Message | None:
    """One request/answer with the prefill node's block server; None when it does not answer, or
    when the exchange cannot be authenticated or speaks another protocol version (logged)."""
    global _ctx
    endpoint = params.remote_endpoints["tcp"]
    try:
        codec = _codec(is_loopback(urlsplit(endpoint).hostname or ""))
    except ConfigError as exc:
        log.error("cannot sign KV control messages to %s: %s", endpoint, exc.message)
        return None
    _ctx = _ctx or zmq.asyncio.Context()
    sock = _ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send(codec.encode(msg))
        if not await sock.poll(int(timeout_s * 1000)):
            return None
        answer = codec.decode(await sock.recv())
    except (PeerUnauthenticated, UpstreamError, VersionMismatch) as exc:
        log.warning("answer from the block server at %s refused: %s", endpoint, exc.message)
        return None
    finally:
        sock.close(0)
    if isinstance(answer, wire.Reject) and answer.reason.startswith("unauthenticated"):
        log.warning("the block server at %s refused our MAC (cluster secrets differ?): %s", endpoint, answer.reason)
    elif isinstance(answer, wire.Reject) and answer.reason.startswith(wire.VERSION_REJECT):
        log.error("the block server at %s speaks another protocol: %s", endpoint, answer.reason)
    return answer


async def release_lease(params: dict[str, Any], reason: str, *, timeout_s: float = 2.0) -> bool:
    """Ask the prefill node named in ``params`` (its kv_transfer_params) to free the lease now.
    Returns whether it acknowledged; a dead node has nothing left to free, and the lease deadline is
    the backstop either way."""
    if not is_tandem_params(params):
        return False
    typed = _params(params, "release")
    if typed is None:
        return False
    answer = await _ask(typed, wire.Release(typed.transfer_id, reason), timeout_s)
    if answer is None:
        log.warning("prefill node did not acknowledge the release of %s", typed.transfer_id)
    return isinstance(answer, wire.Ack)


async def lease_report(params: dict[str, Any], *, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The transfer as the prefill node saw it, a ``TransferReport`` (``source="prefill"``) as a dict, in
    the shape of the decode node's own report; None when the
    node does not know the lease (restarted, or too long ago) or does not answer."""
    if not is_tandem_params(params):
        return None
    typed = _params(params, "lease report query")
    if typed is None:
        return None
    try:
        answer = await _ask(typed, wire.Query(typed.transfer_id), timeout_s)
    except zmq.ZMQError as exc:
        log.warning("lease report for %s: %s", typed.transfer_id, exc)
        return None
    if not isinstance(answer, wire.LeaseReport):
        return None
    ended = answer.end > 0 and answer.start > 0
    return TransferReport(
        ok=answer.state == "done",
        bytes=answer.nbytes or None,
        transport=answer.transport or None,
        seconds=round(answer.end - answer.start, 6) if ended else None,
        reason=answer.reason,
        start=answer.start or None,
        end=answer.end if ended else None,
        state=answer.state,
        source="prefill",
    ).to_dict()
