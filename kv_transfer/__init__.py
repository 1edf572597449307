"""KV transfer between prefill and decode nodes: connector choice and per-request transfer params."""

from kv_transfer.config import ConnectorKind, kv_transfer_config, prefill_request_params

__all__ = ["ConnectorKind", "kv_transfer_config", "prefill_request_params"]
