"""The engine arguments that suit a prefill node."""

from __future__ import annotations


def engine_args(max_model_len: int) -> list[str]:
    # A prefill node answers each request with one token, so its steps are all prompt work and a large
    # token budget costs no decode stall: long prompts go in few big steps. Capped at 4096 because the
    # engine's start-up profiling runs one step of the full budget (8192 float32 tokens took minutes on
    # one CPU core), and past a few thousand tokens a step is compute-bound anyway.
    return ["--max-num-batched-tokens", str(min(4096, max_model_len))]
