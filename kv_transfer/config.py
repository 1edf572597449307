"""Which KV connector an engine runs, as one setting, and the vLLM ``--kv-transfer-config`` it implies.

``tandem`` (default) is our own connector (``kv_connector.connector``): leased blocks pulled over
ZeroMQ tcp/ipc or copied across processes on one host. ``nixl`` is vLLM's NixlConnector (UCX through
NIXL) with host buffers on CPU: the baseline we measure against. ``none`` runs an engine without a
connector: it can only serve colocated requests.
"""

from __future__ import annotations

import enum
import json
from typing import Any


class ConnectorKind(enum.StrEnum):
    TANDEM = "tandem"
    NIXL = "nixl"
    NONE = "none"


class TransportName(enum.StrEnum):
    """How a decode node pulls a prefill node's KV: ``auto`` = ``shm`` (one kernel copy) when both nodes
    are on one host, else ``tcp``. ``ipc`` = ZeroMQ over a Unix socket (one host). ``ucx`` = UCX through
    ucxx-cu12 (``UCX_TLS`` picks its transports; never chosen by ``auto``). The one list of these names:
    settings, the wire's ``Pull.transport``, the pullers, the senders and the benchmarks use it."""

    AUTO = "auto"
    TCP = "tcp"
    IPC = "ipc"
    SHM = "shm"
    UCX = "ucx"


LAYERWISE_TRANSPORTS = frozenset({TransportName.TCP, TransportName.IPC, TransportName.SHM})
"""The transports a layer-wise pull runs over (frames or kernel copies; not ucx)."""
ONE_HOST_TRANSPORTS = frozenset({TransportName.IPC, TransportName.SHM})
"""The transports that reach a peer on this host only (a Unix socket, a cross-memory copy)."""


def kv_transfer_config(
    kind: ConnectorKind,
    *,
    buffer_device: str = "cpu",
    extra: dict[str, Any] | None = None,
    load_failure_policy: str = "recompute",
) -> str | None:
    """The JSON for ``--kv-transfer-config``, or None when the engine runs without a connector.

    Both connectors move KV either way, so prefill and decode engines both run ``kv_both``: which
    side a request plays is decided per request by its ``kv_transfer_params``. ``load_failure_policy``
    ``recompute`` makes a decode node whose pull failed prefill the prompt itself (the client still
    gets its answer); ``fail`` ends such a request with an error."""
    if kind is ConnectorKind.NONE:
        return None
    if kind is ConnectorKind.TANDEM:
        return json.dumps(
            {
                "kv_connector": "TandemConnector",
                "kv_connector_module_path": "kv_connector.connector",
                "kv_role": "kv_both",
                "kv_buffer_device": buffer_device,
                "kv_load_failure_policy": load_failure_policy,
                "kv_connector_extra_config": extra or {},
            }
        )
    if kind is ConnectorKind.NIXL:
        return json.dumps(
            {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "kv_buffer_device": buffer_device,
                "kv_load_failure_policy": load_failure_policy,
            }
        )
    raise ValueError(f"unknown connector {kind!r}")


def prefill_request_params() -> dict[str, object]:
    """``kv_transfer_params`` for the prefill leg: compute the prompt, keep its blocks for a remote decode.
    Both connectors read ``do_remote_decode``; the None fields are NixlConnector's."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
