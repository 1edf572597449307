"""The KV primitives under the role packages: the wire protocol (``wire``), the transports (``transports``,
``ucx``), the cache layout (``layout``), checksums and peer credentials (``auth``), the connector choice and
per-request transfer params (``config``). Nothing here imports a role package; the connector vLLM loads,
which wires the role halves together, is the package above them, ``kv_connector``."""

from pathlib import Path

from kv_transfer.config import ConnectorKind, TransportName, kv_transfer_config, prefill_request_params

ENGINE_HOOKS = Path(__file__).parent / "engine_hooks"
"""Folder put first on engine processes' PYTHONPATH: its sitecustomize adjusts NIXL at start-up."""

__all__ = ["ENGINE_HOOKS", "ConnectorKind", "TransportName", "kv_transfer_config", "prefill_request_params"]
