"""Counting prompt tokens in the router with the served model's own tokenizer and chat template.

Used before any node is involved, so an over-long request is refused with a 400 instead of occupying
a prefill node (and, in P/D, KV blocks held for a decode that would then refuse it). Nodes register
their model folder; a router on another host without that folder skips the check and lets the
engine refuse instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infra.registry import NodeInfo

log = logging.getLogger("tandem.router.tokenizer")


class PromptTokenizer:
    def __init__(self) -> None:
        self._tokenizers: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    async def _get(self, node: NodeInfo) -> Any | None:
        path = node.model_path
        if not path:
            return None
        if path not in self._tokenizers:
            async with self._lock:
                if path not in self._tokenizers:
                    self._tokenizers[path] = await asyncio.to_thread(_load, path)
        return self._tokenizers[path]

    async def count(self, node: NodeInfo, body: dict[str, Any]) -> int | None:
        """Prompt length in tokens as the engine will see it, or None when it cannot be known here."""
        tok = await self._get(node)
        if tok is None:
            return None
        return await asyncio.to_thread(_count, tok, body)


def _load(path: str) -> Any | None:
    if not Path(path).is_dir():
        return None  # the node's model folder is not on this host
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _count(tok: Any, body: dict[str, Any]) -> int:
    if "messages" in body:
        ids = tok.apply_chat_template(
            body["messages"], tools=body.get("tools"), add_generation_prompt=True, tokenize=True,
            **(body.get("chat_template_kwargs") or {}),
        )
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding (a Mapping)
            ids = ids["input_ids"]
        return len(ids)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    return len(tok(prompt or "")["input_ids"])
