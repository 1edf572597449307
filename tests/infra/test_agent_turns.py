"""infra.agent_turns.EndTurn, the logits processor that ends agent-test answers: it follows vLLM's
persistent batch (removed, added, moved, swapped) and forces the end token only on rows whose answer
has reached the limit."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from infra.agent_turns import LIMIT, EndTurn

EOS = 2
VOCAB = 8


def _processor(eos: Any = EOS) -> EndTurn:
    config = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(eos_token_id=eos)))
    return EndTurn(config, torch.device("cpu"), False)  # type: ignore[arg-type]


def _update(size: int, removed=(), added=(), moved=()) -> BatchUpdate:  # type: ignore[no-untyped-def]
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def _argmax(proc: EndTurn, rows: int) -> list[int]:
    logits = torch.zeros(rows, VOCAB)
    logits[:, 5] = 10.0  # the model's own choice, everywhere
    return proc.apply(logits).argmax(dim=1).tolist()


def test_only_answers_at_the_limit_are_ended() -> None:
    proc = _processor()
    short, long_ = [1] * (LIMIT - 1), [1] * LIMIT
    proc.update_state(_update(2, added=[(0, None, [9], short), (1, None, [9], long_)]))
    assert _argmax(proc, 2) == [5, EOS]
    short.append(1)  # the engine appends to the live list; no batch update comes
    proc.update_state(None)
    assert _argmax(proc, 2) == [EOS, EOS]


def test_it_follows_removals_moves_and_swaps() -> None:
    proc = _processor()
    ended, fresh = [1] * LIMIT, [1]
    proc.update_state(_update(2, added=[(0, None, None, ended), (1, None, None, fresh)]))
    proc.update_state(_update(2, moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert _argmax(proc, 2) == [5, EOS]
    proc.update_state(_update(1, removed=[0], moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert _argmax(proc, 1) == [EOS]
    proc.update_state(_update(1, removed=[0], added=[(0, None, None, [1])]))
    assert _argmax(proc, 1) == [5]


def test_a_list_of_end_tokens_uses_the_first() -> None:
    proc = _processor(eos=[3, 4])
    proc.update_state(_update(1, added=[(0, None, None, [1] * LIMIT)]))
    assert _argmax(proc, 1) == [3]
