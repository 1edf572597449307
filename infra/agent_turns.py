"""A vLLM logits processor that ends every answer of an engine serving the agent clients within a fixed
number of tokens, with the model's own end-of-sequence token: loaded by the engine through
``--logits-processors infra.agent_turns:EndTurn`` (``infra.agent_clients.agent_engine_args``).

Why: a coding agent's turn completes only when the model ends its answer itself. Claude Code answers
``stop_reason: max_tokens`` by asking the model to continue, three times, then exits 1 ("exceeded the
32000 output token maximum"); Codex keeps the truncated answer. Whether the 135M model the tests serve
ends its answer greedily is the model's whim: its prompt changes from day to day and host to host
(Claude Code puts the date, the working folder and the kernel's version in it) and the engine's dtype
with the CPU (bfloat16 or float32). On one CI host every answer ran to the cap; on the hosts tried
since, the same test answered "Hello." for every date tried. A test that relies on it passes on one
host and fails on another. With this processor every answer ends by ``LIMIT`` tokens with
``end_turn`` / ``completed``, as a capable model's short answer does, and what the agent tests check
is the protocol, not the model's manners.

It only adds the end token's choice once an answer is ``LIMIT`` tokens long: shorter answers and the
prompt are untouched, so the prefix cache, the KV transfer and the router see ordinary requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

if TYPE_CHECKING:
    from vllm.config import VllmConfig

LIMIT = 48
"""Generated tokens after which the end-of-sequence token is the only choice: under the engine's
``max_new_tokens`` cap (``AGENT_GENERATION``), so an answer ends rather than being cut."""


def _eos_token(vllm_config: VllmConfig) -> int:
    eos = vllm_config.model_config.hf_config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    if not isinstance(eos, int):
        raise ValueError(f"EndTurn needs the model's eos_token_id; its config has {eos!r}")
    return eos


class EndTurn(LogitsProcessor):
    """Forces the end-of-sequence token for each request in the batch whose answer holds ``LIMIT``
    tokens. It follows the persistent batch (removed, then added, then moved, as vLLM orders them) and
    reads each request's live list of output tokens."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.eos = _eos_token(vllm_config)
        self.outputs: dict[int, list[int]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.outputs.pop(index, None)
        for index, _params, _prompt, output in batch_update.added:
            self.outputs[index] = output
        for a, b, direction in batch_update.moved:
            moving, replaced = self.outputs.pop(a, None), self.outputs.pop(b, None)
            if direction == MoveDirectionality.SWAP and replaced is not None:
                self.outputs[a] = replaced
            if moving is not None:
                self.outputs[b] = moving

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = [index for index, output in self.outputs.items() if len(output) >= LIMIT and index < logits.shape[0]]
        if rows:
            ended = torch.full_like(logits[rows], float("-inf"))
            ended[:, self.eos] = 0.0
            logits[rows] = ended
        return logits
