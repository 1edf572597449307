"""Prompt token ids in the router, with the served model's own tokenizer and chat template.

Used before any node is involved: an over-long request is refused with a 400 instead of occupying a
prefill node (and, in P/D, KV blocks held for a decode that would then refuse it), and the routing
keys are computed from exactly the tokens the engine will hash. Nodes register their model folder; a
router on another host without that folder skips both and lets the engine refuse instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

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

    async def token_ids(self, node: NodeInfo, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine will see them, or None when they cannot be known here."""
        tok = await self._get(node)
        if tok is None:
            return None
        try:
            if _prompt_chars(body) <= INLINE_CHARS:
                return _token_ids(tok, body)  # shorter than the hand-off to a thread would cost
            return await asyncio.to_thread(_token_ids, tok, body)
        except (TemplateError, ValueError, TypeError, KeyError) as exc:
            # The engine renders the same template and will answer this request with its own error;
            # the router only loses its length check and routing keys for it.
            log.warning("cannot render prompt for %s: %s", node.model, exc)
            return None


INLINE_CHARS = 16_384
"""Prompts up to this many characters (~4k tokens) are rendered and encoded on the event loop: that
takes a few hundred microseconds, less than handing the work to a thread and back (measured on a
2-core host: the hand-off cost more CPU than encoding a 512-token prompt). Longer ones go to a thread
so that no stream waits on them."""


def _prompt_chars(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(c) if isinstance(c := m.get("content"), str) else INLINE_CHARS
                   for m in messages if isinstance(m, dict)) + len(str(body.get("tools") or ""))
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, str) else INLINE_CHARS + 1


def _load(path: str) -> Any | None:
    if not Path(path).is_dir():
        return None  # the node's model folder is not on this host
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _token_ids(tok: Any, body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        # As vLLM does before rendering: a message without content (an assistant turn that only calls
        # tools) renders as empty text, not as a missing attribute.
        messages = [{**m, "content": m.get("content") or ""} for m in body["messages"]]
        rust = getattr(tok, "_tokenizer", None)
        if rust is not None and hasattr(rust, "encode"):
            # Render, then encode with the Rust tokenizer directly: what apply_chat_template(tokenize=True)
            # does (no special tokens added to a rendered chat, as vLLM), without the BatchEncoding and
            # padding machinery around it, which cost as much as the encoding on every request.
            text = tok.apply_chat_template(
                messages, tools=body.get("tools"), add_generation_prompt=True, tokenize=False,
                **(body.get("chat_template_kwargs") or {}),
            )
            return list(rust.encode(text, add_special_tokens=False).ids)
        ids = tok.apply_chat_template(
            messages, tools=body.get("tools"), add_generation_prompt=True, tokenize=True,
            **(body.get("chat_template_kwargs") or {}),
        )
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding (a Mapping)
            ids = ids["input_ids"]
        return list(ids)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return list(prompt)
    return list(tok(prompt or "")["input_ids"])
