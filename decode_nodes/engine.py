"""The engine arguments that suit a decode node."""

from __future__ import annotations


def engine_args(max_model_len: int) -> list[str]:
    # Decode steps are one token per running request; a decode node still prefills prompts that are
    # routed to it without a transfer (colocated fallback), so chunked prefill keeps those from
    # stalling the running streams. 2048 tokens per step bounds that stall.
    return ["--max-num-batched-tokens", str(min(2048, max_model_len))]
