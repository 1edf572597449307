"""Prefill nodes: engines that compute prompts and hand their KV to decode nodes.

This package holds what is specific to the prefill role: the engine arguments that suit it. The node
process itself (engine supervision, registry, heartbeat) is shared by every role: ``infra.node``.
"""

from __future__ import annotations

from infra.node_settings import NodeSettings


def engine_args(settings: NodeSettings) -> list[str]:
    # A prefill node answers each request with one token, so its steps are all prompt work and a large
    # token budget costs no decode stall: long prompts go in few big steps. Capped at 4096 because the
    # engine's start-up profiling runs one step of the full budget (8192 float32 tokens took minutes on
    # one CPU core), and past a few thousand tokens a step is compute-bound anyway.
    return ["--max-num-batched-tokens", str(min(4096, settings.max_model_len))]


__all__ = ["engine_args"]
