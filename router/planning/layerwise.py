"""Layer-wise P/D pairs (issue 19): the router sends both legs at once, so the decode node pulls each
layer of the prompt while the prefill node computes it, and what the transfer adds after the prefill
is about one layer instead of the whole prompt's KV.

    plan ─┬─▶ decode leg   kv_transfer_params = TransferParams(layerwise, transfer_id=T, the prefill
          │                node's block server as the registry advertises it, no block ids)
          │                its pull waits at that block server, then takes each layer as it is written
          └─▶ prefill leg  max_tokens=1, do_remote_decode, tandem_layerwise_id=T
                           (``contracts.transfer.LAYERWISE_ID_KEY``; the prefill scheduler opens the lease
                           under T when the request's blocks are first allocated)

    plan returns at the first of
      the decode leg is ready (a stream's first events, a whole answer; or it failed)
          → the decode leg's outcome stands; the prefill leg runs on to its end in the background
            (its answer, a token later, only carries the prefill node's cached-token figure)
      the prefill leg ended well        → the decode leg goes on (its answer is the client's)
      the prefill leg failed            → the decode leg is cancelled (its connection closed: vLLM
                                          aborts it, its pull ends and frees its blocks), T is released
                                          at the prefill node (a pull parked there is answered at once),
                                          then as for a sequential pair: the client's 4xx is answered;
                                          otherwise ``prefill_fallback`` (a fresh leg on the decode node
                                          without transfer, or 502)

T is the router's: a fresh uuid per request (a prefill scheduler refuses a T it has seen, so no decode
leg can pull another request's lease). Whoever ends first, ``Pair.cancel`` ends the rest: the
exchange's exit calls it (``Leg.release``), so a client that leaves cancels both legs wherever they
are, and a decode node that dies mid-pull leaves a lease that expires ``lease_s`` after its prefill
ends (``prefill_nodes.lease``).

A pair goes layer-wise only when ``RouterSettings.layerwise`` is on, both nodes run our connector, the
prefill node's registry entry names its block server (``NodeInfo.kv_endpoints``, schema 3), and the
prefill node reported no request waiting at its last heartbeat: a layer-wise pull that arrives before its
lease opens is parked for at most the block server's ``PARK_S`` (10 s), and a decode node gives up on a
silent pull after its ``transfer_timeout_s`` (10 s), so a prefill that queues longer than that would end
in a recompute on the decode node. Any other pair goes sequentially (prefill, then a whole pull).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import AsyncExitStack
from typing import Any

from contracts.registry import NodeInfo, Role
from contracts.transfer import LAYERWISE_ID_KEY, TransferParams
from kv_transfer import prefill_request_params
from router.policies.base import Candidate

log = logging.getLogger("tandem.router.layerwise")

TANDEM = "tandem"
"""``NodeInfo.kv_connector`` of a node running our connector (``kv_transfer.ConnectorKind.TANDEM``)."""


def eligible(prefill: Candidate, decode: Candidate) -> bool:
    """Whether this pair can go layer-wise (see the module docstring)."""
    p, d = prefill.node.info, decode.node.info
    return (
        p.kv_connector == TANDEM
        and d.kv_connector == TANDEM
        and d.role is Role.DECODE
        and bool(p.kv_endpoints)
        and prefill.node.load.waiting == 0
    )


def new_transfer_id() -> str:
    return f"lw-{uuid.uuid4().hex}"


def decode_params(prefill: NodeInfo, transfer_id: str, deadline: float) -> dict[str, Any]:
    """The decode leg's kv_transfer_params: pull ``transfer_id`` by prompt position from ``prefill``'s
    block server. ``deadline`` bounds only the decode node's admission check (a layer-wise pull's own
    timeout is a stall timeout, and the prefill node's lease has none until its prefill ends)."""
    return TransferParams(
        transfer_id=transfer_id,
        remote_block_ids=[],
        remote_endpoints=prefill.kv_endpoints,
        remote_host_id=prefill.kv_host_id,
        remote_engine_id=prefill.node_id,
        remote_num_tokens=0,
        lease_deadline=deadline,
        layerwise=True,
    ).to_dict()


def prefill_params(transfer_id: str) -> dict[str, Any]:
    """The prefill leg's kv_transfer_params: compute, and open the lease under ``transfer_id``."""
    return {**prefill_request_params(), LAYERWISE_ID_KEY: transfer_id}


class Pair:
    """The two legs of a layer-wise request in flight: ``decode`` resolves to the decode leg's answer
    (a dict) or, streamed, to its opened stream and the stack that closes it; ``prefill`` to nothing (it
    fills the trace). Both are tasks started by the orchestrator; this object owns ending them."""

    def __init__(self, decode: asyncio.Task[Any], prefill: asyncio.Task[None]) -> None:
        self.decode = decode
        self.prefill = prefill
        self._claimed = False
        prefill.add_done_callback(_retrieve)
        decode.add_done_callback(_retrieve)

    async def first(self) -> None:
        """Wait for the decode leg to be ready or the prefill leg to end, whichever comes first.
        Cancelled (the client left): both legs are cancelled."""
        try:
            await asyncio.wait((self.decode, self.prefill), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await self.cancel()
            raise

    def prefill_failed(self) -> BaseException | None:
        """The prefill leg's failure, if it ended so (and nothing if it is still running or ended well)."""
        if not self.prefill.done() or self.prefill.cancelled():
            return None
        return self.prefill.exception()

    async def claim_decode(self) -> Any:
        """The decode leg's result (raises its failure); the caller owns a stream from then on."""
        result = await self.decode
        self._claimed = True
        return result

    async def prefill_ended(self) -> None:
        """Wait for the prefill leg to end, however it ends (its failure was handled where it mattered)."""
        await asyncio.wait((self.prefill,))  # raises nothing of the leg's; cancelling the caller leaves it

    async def cancel(self) -> None:
        """End whatever is still running: a pending leg is cancelled (its connection closed, so its
        engine aborts the request), a stream nobody claimed is closed. Idempotent."""
        for task in (self.decode, self.prefill):
            task.cancel()
        if self.decode.done() and not self.decode.cancelled() and not self._claimed:
            result = self.decode.result() if self.decode.exception() is None else None
            self._claimed = True
            if isinstance(result, tuple) and isinstance(result[1], AsyncExitStack):
                await result[1].aclose()


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Take a leg's failure out of its task, so one that nobody awaited (it did not matter any more)
    is logged here rather than as 'exception never retrieved'."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.info("layer-wise leg ended: %s: %s", type(exc).__name__, exc)
