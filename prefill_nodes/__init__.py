"""Prefill nodes: engines that compute prompts and hand their KV to decode nodes.

This package holds what is specific to the prefill role: the engine arguments that suit it. The node
process itself (engine supervision, registry, heartbeat) is shared by every role: ``infra.node``.
"""

from __future__ import annotations

from infra.node_settings import NodeSettings


def engine_args(settings: NodeSettings) -> list[str]:
    # A prefill node answers each request with one token, so its steps are all prompt work. A token
    # budget of a whole context lets a long prompt go in one step instead of being chunked, which is
    # what minimises time to first token when there is no decode batch to protect.
    return ["--max-num-batched-tokens", str(settings.max_model_len)]


__all__ = ["engine_args"]
