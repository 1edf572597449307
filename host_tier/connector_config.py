"""The ``--kv-transfer-config`` of an engine that uses the host tier (``host_tier.connector``), with
or without a P/D connector beside it. Free of vLLM imports: the node agent builds it.

A colocated engine runs the tier connector alone. A prefill or decode engine runs vLLM's
``MultiConnector`` with the P/D connector first: vLLM gives each request to the first connector that
claims tokens for it, so a decode leg's remote prefill stays with the P/D connector, and every other
request may load from the tier. Both see ``request_finished``, so a prefill node's prompt blocks are
both leased to its decode node and offloaded to the tier.
"""

from __future__ import annotations

import json
from typing import Any


def tier_connector(endpoint: str, timeout_s: float = 0.5) -> dict[str, Any]:
    return {
        "kv_connector": "HostTierConnector",
        "kv_connector_module_path": "host_tier.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tier_endpoint": endpoint, "tier_timeout_s": timeout_s},
    }


def with_host_tier(
    pd_config: str | None, endpoint: str, load_failure_policy: str = "recompute", timeout_s: float = 0.5
) -> str:
    """``pd_config``: the P/D connector's JSON (``kv_transfer.config.kv_transfer_config``), or None;
    ``timeout_s``: the tier's answer to one lookup (``NodeSettings.host_tier_timeout_s``)."""
    tier = tier_connector(endpoint, timeout_s)
    if pd_config is None:
        return json.dumps({**tier, "kv_load_failure_policy": load_failure_policy})
    pd = json.loads(pd_config)
    return json.dumps(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": load_failure_policy,
            "kv_buffer_device": pd.get("kv_buffer_device", "cpu"),
            "kv_connector_extra_config": {"connectors": [pd, tier]},
        }
    )
