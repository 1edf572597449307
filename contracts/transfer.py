"""``kv_transfer_params`` and the transfer report: what a prefill node, the router and a decode node tell
each other about one request's KV, typed and versioned.

    prefill engine ── request_finished ──▶ TransferParams, as the ``kv_transfer_params`` of its answer
    router         ── copies them unchanged into the decode leg's body
    decode engine  ── admits them (``decode_nodes.admission``), pulls, and answers a non-streamed request
                      with ``{"tandem_transfer": TransferReport}`` as its ``kv_transfer_params``
    router         ── after a streamed answer asks the prefill node instead (``kv_transfer.control``):
                      a ``TransferReport`` with ``source="prefill"``

Both travel as JSON inside vLLM's ``kv_transfer_params`` dict (vLLM keeps the request's dict and our
scheduler flips its ``do_remote_prefill`` flag in place), so each struct converts to and from that dict:
``to_dict`` / ``from_dict``. ``from_dict`` checks the version before anything else, so params of another
release are a ``VersionMismatch`` naming both versions, never a ``KeyError`` further down.

Versions (``PARAMS_VERSION``, the ``tandem`` field of both)
    1  the first: transfer id, the prefill node's block ids, block server endpoints, host id, engine id,
       prompt tokens computed, lease deadline; optionally the transport the decode node must use. A
       report without a ``tandem`` field is a version-1 report (they carried none). Later, compatible
       additions (optional, absent from the dict when unset): ``layerwise``; ``prefix_tokens`` (a peer
       prefix fetch, ``router.planning.peer_fetch``: a node of an older release ignores it, pulls the whole
       prompt, finds the lease too short, and recomputes); ``split`` (a node of an older release loads
       the prefix before computing the rest, as for a layer-wise peer fetch: slower, still correct).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from contracts.errors import UpstreamError, VersionMismatch

PARAMS_VERSION = 1


LAYERWISE_ID_KEY = "tandem_layerwise_id"
"""In a prefill leg's kv_transfer_params (beside ``do_remote_decode``): the transfer id its decode leg,
sent at the same time with ``TransferParams.layerwise``, pulls under."""


class TransferParams(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request's KV waits: handed out by the prefill node for the blocks it leased."""

    tandem: int = PARAMS_VERSION
    """The version of these params (``PARAMS_VERSION``); also what marks them as ours."""
    do_remote_prefill: bool = True
    """vLLM's flag: the decode node loads this request's prompt KV from a peer (cleared once admitted)."""
    do_remote_decode: bool = False
    transfer_id: str
    """The lease's id on the prefill node (its engine's request id)."""
    remote_block_ids: list[int]
    """The prefill node's KV block ids of the prompt, in order."""
    remote_endpoints: dict[str, str]
    """The prefill node's block server: ``{"tcp": "tcp://host:port", "ipc": "ipc://..."}``."""
    remote_host_id: str
    """Identifies the prefill node's host: the same id here makes ``shm`` possible."""
    remote_engine_id: str
    remote_num_tokens: int
    """Prompt tokens the prefill node computed."""
    lease_deadline: float
    """Wall clock by which the decode node must have pulled; past it the blocks are freed."""
    transport: str | None = None
    """Forces a transport (``tcp``, ``ipc``, ``shm``, ``ucx``); None: the decode node's own choice."""
    layerwise: bool = False
    """Sent with the prefill leg, before the prefill has run: the decode node pulls by prompt position
    (``remote_block_ids`` is empty) while the prefill computes, layer by layer; ``transfer_id`` is the
    one the sender gave the prefill leg (``LAYERWISE_ID_KEY``). tcp, ipc and shm only."""
    prefix_tokens: int | None = None
    """A peer prefix fetch (``router.planning.peer_fetch``): only the prompt's first ``prefix_tokens`` (whole
    blocks, fewer than the prompt) come from the peer, which leased just those; the node computes the
    rest itself. None: the whole prompt comes from the peer (P/D)."""
    prefix_key: int | None = None
    """With ``prefix_tokens``: the router's key of the prefix's last block (``block_key`` of the engine's
    chain hash, which covers every token before it and the cache salt). Blocks move by position, so the
    node loads them only if its own hash of that block agrees: a prompt it tokenized otherwise than the
    peer's leg is computed, never given the peer's KV."""
    split: bool = False
    """A split prefill (with ``layerwise`` and ``prefix_tokens``): the peer computes the prefix while this
    node computes the rest of the prompt in the same engine step, each attention layer waiting for the
    prefix's KV of that layer (a synchronous load, ``kv_connector.layer_gate``). Without it the node
    waits for the whole prefix before it computes anything (an asynchronous load)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        if self.transport is None:
            del out["transport"]
        if not self.layerwise:
            del out["layerwise"]
        if self.prefix_tokens is None:
            del out["prefix_tokens"]
        if self.prefix_key is None:
            del out["prefix_key"]
        if not self.split:
            del out["split"]
        return out

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> TransferParams:
        """The params in a ``kv_transfer_params`` dict; ``VersionMismatch`` for another version,
        ``UpstreamError`` for a dict of this version that is malformed."""
        version = params.get("tandem")
        if version != PARAMS_VERSION:
            raise VersionMismatch("kv_transfer_params", theirs=version, ours=PARAMS_VERSION)
        try:
            return msgspec.convert(dict(params), cls)
        except msgspec.ValidationError as exc:
            raise UpstreamError(f"malformed kv_transfer_params: {exc}") from exc


def block_key(block_hash: bytes) -> int:
    """A block's key as the router's fleet index holds it: the low 64 bits of the engine's block hash."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


def is_transfer_params(params: Mapping[str, Any] | None) -> bool:
    """Whether a ``kv_transfer_params`` dict names a Tandem transfer (of any version)."""
    return bool(params) and "transfer_id" in params and "remote_endpoints" in params  # type: ignore[operator]


class TransferReport(msgspec.Struct, frozen=True, kw_only=True):
    """How one transfer went, as the decode node (its pull) or the prefill node (its lease) saw it: the
    lake's transfer fields of the request's record."""

    ok: bool
    bytes: int | None = None
    seconds: float | None = None
    transport: str | None = None
    reason: str = ""
    start: float | None = None
    """Wall clock: the pull started (decode) or arrived (prefill)."""
    end: float | None = None
    """Wall clock: the pull finished (decode) or the lease ended (prefill)."""
    state: str | None = None
    """The prefill node's lease state (``done``, ``failed``, ``released``, ``expired``); decode: None."""
    source: Literal["decode", "prefill"] = "decode"
    tandem: int = PARAMS_VERSION

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    @classmethod
    def from_dict(cls, report: Mapping[str, Any]) -> TransferReport:
        version = report.get("tandem", 1)
        if version != PARAMS_VERSION:
            raise VersionMismatch("transfer report", theirs=version, ours=PARAMS_VERSION)
        try:
            return msgspec.convert(dict(report), cls)
        except msgspec.ValidationError as exc:
            raise UpstreamError(f"malformed transfer report: {exc}") from exc


__all__ = ["PARAMS_VERSION", "TransferParams", "TransferReport", "block_key", "is_transfer_params"]
