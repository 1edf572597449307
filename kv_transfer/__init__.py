"""KV transfer between prefill and decode nodes: connector choice and per-request transfer params."""

from pathlib import Path

from kv_transfer.config import ConnectorKind, kv_transfer_config, prefill_request_params

ENGINE_HOOKS = Path(__file__).parent / "engine_hooks"
"""Folder put first on engine processes' PYTHONPATH: its sitecustomize adjusts NIXL at start-up."""

__all__ = ["ENGINE_HOOKS", "ConnectorKind", "kv_transfer_config", "prefill_request_params"]
