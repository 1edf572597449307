"""What the scheduler half tells the worker half each engine step (vLLM pickles it across)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from contracts.transfer import TransferReport


@dataclass
class RecvSpec:
    """Decode side: pull these remote blocks into these local ones."""

    request_id: str
    transfer_id: str
    endpoints: dict[str, str]
    host_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    lease_deadline: float
    """Wall clock: the prefill node frees the blocks then, pulled or not."""
    transport: str | None = None
    """Per-request choice (``kv_transfer_params["transport"]``), else the node's setting."""
    layerwise: bool = False
    """``remote_block_ids`` are prompt positions: pull while the prefill computes."""
    split: bool = False
    """Loaded synchronously: this step computes the rest of the prompt, each attention layer waiting for
    the pull to have written that layer (``TransferParams.split``)."""


@dataclass
class LeaseSpec:
    """Prefill side: hold these blocks for a remote decode until ``deadline`` (wall clock)."""

    transfer_id: str
    block_ids: list[int]
    deadline: float


@dataclass
class FillSpec:
    """Prefill side, layer-wise: this step computes the last of the prompt; report each layer of it,
    as it is written, for the lease ``transfer_id`` over these blocks."""

    transfer_id: str
    block_ids: list[int]
    request_id: str = ""
    """The request filling it (a lease another request opened under the same id is left alone)."""


@dataclass
class FillEnd:
    """Prefill side, layer-wise: the prefill ended (``ok``) or failed or was aborted half-way."""

    transfer_id: str
    ok: bool
    reason: str = ""
    request_id: str = ""


@dataclass
class ReleaseSpec:
    """Decode side: tell a prefill node to free a lease without pulling it."""

    endpoints: dict[str, str]
    host_id: str
    transfer_id: str
    reason: str


@dataclass
class TandemMetadata(KVConnectorMetadata):
    recvs: list[RecvSpec] = field(default_factory=list)
    leases: list[LeaseSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    """Decode side: requests aborted while their pull was in flight."""
    opens: list[tuple[str, str]] = field(default_factory=list)
    """Prefill side, layer-wise: (transfer id, request id) of leases to open as their prefill starts."""
    fills: list[FillSpec] = field(default_factory=list)
    fill_ends: list[FillEnd] = field(default_factory=list)
    idle: bool = False
    """This step computes nothing (it only waits for transfers): the worker may sleep briefly until a
    transfer ends instead of letting the engine loop spin (see ``ConnectorSettings.idle_wait_ms``)."""

    def empty(self) -> bool:
        return not (
            self.recvs or self.leases or self.releases or self.cancels or self.opens or self.fills or self.fill_ends
        )


@dataclass
class TransferReports(KVConnectorWorkerMetadata):
    """Worker → scheduler: how each finished pull went (``contracts.transfer.TransferReport``), so the
    decode engine can return it with the request (``tandem_transfer`` in its kv_transfer_params) for the
    router's per-request record."""

    reports: dict[str, TransferReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, TransferReports):
            self.reports.update(other.reports)
        return self
