"""Which KV connector an engine runs, as one setting, and the vLLM ``--kv-transfer-config`` it implies.

``nixl`` is vLLM's NixlConnector (UCX through NIXL) with host buffers on CPU: the baseline transport
and, until our own connector lands, the default. ``none`` runs an engine without a connector: it can
only serve colocated requests.
"""

from __future__ import annotations

import enum
import json


class ConnectorKind(enum.StrEnum):
    NIXL = "nixl"
    NONE = "none"


def kv_transfer_config(kind: ConnectorKind, *, buffer_device: str = "cpu") -> str | None:
    """The JSON for ``--kv-transfer-config``, or None when the engine runs without a connector.

    NixlConnector moves KV either way over one agent, so prefill and decode engines both run
    ``kv_both``: which side a request plays is decided per request by its ``kv_transfer_params``."""
    if kind is ConnectorKind.NONE:
        return None
    if kind is ConnectorKind.NIXL:
        return json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                           "kv_buffer_device": buffer_device})
    raise ValueError(f"unknown connector {kind!r}")


def prefill_request_params() -> dict[str, object]:
    """``kv_transfer_params`` for the prefill leg: compute the prompt, keep its blocks for a remote decode."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
