"""Decode nodes: engines that load a prompt's KV from a prefill node and generate the answer.

This package holds what is specific to the decode role: the engine arguments that suit it. The node
process itself (engine supervision, registry, heartbeat) is shared by every role: ``infra.node``.
"""

from __future__ import annotations

from infra.node_settings import NodeSettings


def engine_args(settings: NodeSettings) -> list[str]:
    # Decode steps are one token per running request; a decode node still prefills prompts that are
    # routed to it without a transfer (colocated fallback), so chunked prefill keeps those from
    # stalling the running streams. 2048 tokens per step bounds that stall.
    return ["--max-num-batched-tokens", str(min(2048, settings.max_model_len))]


__all__ = ["engine_args"]
