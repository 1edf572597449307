"""Prompt token ids in the router, with the served model's own tokenizer and chat template.

Used before any node is involved: an over-long request is refused with a 400 instead of occupying a
prefill node (and, in P/D, KV blocks held for a decode that would then refuse it), and the routing
keys are computed from exactly the tokens the engine will hash. Nodes register their model folder; a
router on another host without that folder skips both and lets the engine refuse instead.

A session on one WebSocket (``router.edge.codecs.websocket``) resends its whole conversation every turn, and
encoding it is the largest part of the router's work per turn (10-20 ms for 6k tokens on a 2-core host,
where rendering the template takes under half a millisecond). Its ``PrefixTokens`` (``SESSION_TOKENS``,
set for the socket's requests) keep the last prompt's text and ids: a prompt that repeats that text up to
its last special token is encoded from there on only. Special tokens are matched before the text between
them is normalized and split, so the ids up to one never depend on what follows it: the result is the
whole encoding, exactly (only special tokens that strip no whitespace qualify as cuts).

A prompt the router has the tokenizer for but cannot render (a template error, template arguments it
refuses) is the client's error, a 400: the router never serves a prompt it counted as 0 tokens, which
would bypass both the context check and the token limits. The template arguments are vLLM's: the
request's ``add_generation_prompt`` (default true) and ``continue_final_message``, overridden by its
``chat_template_kwargs`` (names from an allowlist, ``router.edge.limits``), and a client ``chat_template`` only
when the operator trusts them.

Rendering is bounded in time (``render_timeout_s``, ``router.template_deadline``): a template that loops
long over a request is cut there and the request refused with a 400 (``invalid_prompt``), so that no
template holds a router thread, or the event loop, for longer. A client's template is always rendered
in a thread, whatever the prompt's length: it is the one an operator cannot vouch for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from contracts.errors import InvalidRequest
from contracts.registry import NodeInfo
from router.template_deadline import RenderTimeout, bound_template, deadline

log = logging.getLogger("tandem.router.tokenizer")


class PrefixTokens:
    """One session's last prompt (see the module docstring): its text and ids up to the last special
    token, where the next prompt's encoding may resume."""

    __slots__ = ("_ids", "_prefix", "_tokenizer", "hits")

    def __init__(self) -> None:
        self._tokenizer: int | None = None
        self._prefix = ""
        self._ids: list[int] = []
        self.hits = 0
        """Prompts encoded from a kept prefix (for tests and metrics)."""

    @property
    def ready(self) -> bool:
        """A prefix is kept: the next prompt of the session is likely encoded from it."""
        return bool(self._prefix)

    def encode(self, rust: Any, text: str) -> list[int]:
        if self._tokenizer == id(rust) and self._prefix and text.startswith(self._prefix):
            self.hits += 1
            base, base_ids = len(self._prefix), self._ids
            encoding = rust.encode(text[base:], add_special_tokens=False)
        else:
            base, base_ids = 0, []
            encoding = rust.encode(text, add_special_tokens=False)
        ids: list[int] = [*base_ids, *encoding.ids]
        cuts = _cut_ids(rust)
        new = encoding.ids
        for k in range(len(new) - 1, -1, -1):
            if new[k] in cuts:
                self._tokenizer = id(rust)
                self._prefix = text[: base + encoding.offsets[k][1]]
                self._ids = ids[: len(base_ids) + k + 1]
                break
        return ids


SESSION_TOKENS: ContextVar[PrefixTokens | None] = ContextVar("tandem_session_tokens", default=None)
"""The current request's session prefix cache (a socket's), or None: every prompt encoded whole."""
_CUTS: dict[int, frozenset[int]] = {}


def _cut_ids(rust: Any) -> frozenset[int]:
    """The special tokens of a tokenizer that are safe cuts: matched whole, stripping no whitespace."""
    cuts = _CUTS.get(id(rust))
    if cuts is None:
        added = rust.get_added_tokens_decoder().items()
        cuts = _CUTS[id(rust)] = frozenset(
            i for i, t in added if t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized)
        )
    return cuts


class PromptTokenizer:
    def __init__(self, *, render_timeout_s: float | None = None) -> None:
        self.render_timeout_s = render_timeout_s
        """Longest one chat-template rendering may take (None: unbounded)."""
        self._tokenizers: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    @property
    def loaded(self) -> frozenset[str]:
        """Model folders whose tokenizer this router holds."""
        return frozenset(p for p, tok in self._tokenizers.items() if tok is not None)

    async def warm(self, paths: Iterable[str]) -> None:
        """Pay before serving what the first request would pay: import ``transformers``, load each
        folder's tokenizer and render and encode one chat with it (the template compiles on its first
        use). A router replica calls this before it answers anything, so a cluster that says READY has
        no cold replica: cold, a replica's first requests waited 4-8 s between arrival and routing
        against a median of 5 ms. A folder that is not on this host is skipped, as for requests."""
        await asyncio.to_thread(_import_transformers)
        for path in dict.fromkeys(p for p in paths if p):
            if path not in self._tokenizers:
                async with self._lock:
                    if path not in self._tokenizers:
                        self._tokenizers[path] = await asyncio.to_thread(_load, path)
            tok = self._tokenizers[path]
            if tok is not None:
                chat = {"messages": [{"role": "system", "content": "warm"}, {"role": "user", "content": "up"}]}
                await asyncio.to_thread(_token_ids, tok, chat, self.render_timeout_s)

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
        timeout = self.render_timeout_s
        try:
            # A session's later prompts are mostly a kept prefix: encoding their end is short.
            session = SESSION_TOKENS.get()
            short = (session is not None and session.ready) or _prompt_chars(body) <= INLINE_CHARS
            if short and body.get("chat_template") is None:
                return _token_ids(tok, body, timeout)  # shorter than the hand-off to a thread would cost
            return await asyncio.to_thread(_token_ids, tok, body, timeout)
        except RenderTimeout as exc:
            log.warning("rendering a prompt for %s passed %s s: refused", node.model, timeout)
            raise InvalidRequest(
                f"rendering the prompt with the chat template took longer than the router allows ({timeout} s)",
                param="messages",
                code="invalid_prompt",
            ) from exc
        except (TemplateError, ValueError, TypeError, KeyError) as exc:
            # The engine renders the same template and would refuse it too; serving it uncounted would
            # skip the context check and charge 0 tokens against the tenant's limits.
            log.info("cannot render prompt for %s: %s", node.model, exc)
            raise InvalidRequest(
                f"the prompt cannot be rendered with the model's chat template: {exc}",
                param="messages" if "messages" in body else "prompt",
                code="invalid_prompt",
            ) from exc


INLINE_CHARS = 16_384
"""Prompts up to this many characters (~4k tokens) are rendered and encoded on the event loop: that
takes a few hundred microseconds, less than handing the work to a thread and back (measured on a
2-core host: the hand-off cost more CPU than encoding a 512-token prompt). Longer ones go to a thread
so that no stream waits on them."""


def _prompt_chars(body: dict[str, Any]) -> int:
    """About how many characters the template renders: every message's text, its tool calls' names and
    arguments (a template that writes them out renders them all: a megabyte of arguments must not be
    rendered on the loop), and the tools. Content of another shape counts as long (off the loop)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(_message_chars(m) for m in messages if isinstance(m, dict)) + len(str(body.get("tools") or ""))
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, str) else INLINE_CHARS + 1


def _message_chars(m: dict[str, Any]) -> int:
    c = m.get("content")
    if isinstance(c, str):
        n = len(c)
    elif isinstance(c, list):
        n = sum(len(str(p.get("text", ""))) for p in c if isinstance(p, dict))
    else:
        n = INLINE_CHARS
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        n += sum(len(str(call)) for call in calls)
    return n


def _import_transformers() -> None:
    # transformers is a lazy module: importing the class is the cost (seconds on a small host).
    from transformers import AutoTokenizer  # noqa: F401


def _load(path: str) -> Any | None:
    if not Path(path).is_dir():
        return None  # the node's model folder is not on this host
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The template's arguments as vLLM builds them: request fields, then ``chat_template_kwargs``."""
    kwargs: dict[str, Any] = {"add_generation_prompt": body.get("add_generation_prompt", True)}
    if body.get("continue_final_message"):
        kwargs["continue_final_message"] = True
    if body.get("chat_template") is not None:  # only present when the operator trusts them (router.edge.limits)
        kwargs["chat_template"] = body["chat_template"]
    kwargs.update(body.get("chat_template_kwargs") or {})
    return kwargs


def _content_text(content: Any) -> Any:
    """A message's content as the engine renders it for a text chat template: a list of content parts
    (OpenAI's ``[{"type": "text", "text": ...}]``, which `vllm bench serve` and many SDK users send)
    becomes its text parts joined by newlines, as vLLM's own parser does; no content is empty text.
    Anything else is left for the template (and its error) to judge."""
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
        return content
    return content or ""


def _token_ids(tok: Any, body: dict[str, Any], render_timeout_s: float | None = None) -> list[int]:
    if "messages" in body:
        # As vLLM does before rendering: a message without content (an assistant turn that only calls
        # tools) renders as empty text, not as a missing attribute.
        messages = [{**m, "content": _content_text(m.get("content"))} for m in body["messages"]]
        tools, kwargs = body.get("tools"), template_kwargs(body)
        rust = getattr(tok, "_tokenizer", None)
        with deadline(render_timeout_s):
            if render_timeout_s:
                bound_template(tok, kwargs.get("chat_template"), tools)
            if rust is not None and hasattr(rust, "encode"):
                # Render, then encode with the Rust tokenizer directly: what apply_chat_template(tokenize=True)
                # does (no special tokens added to a rendered chat, as vLLM), without the BatchEncoding and
                # padding machinery around it, which cost as much as the encoding on every request.
                text = tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
            else:
                text = None
                ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, **kwargs)
        if text is not None:
            session = SESSION_TOKENS.get()
            if session is not None:
                return session.encode(rust, text)
            return list(rust.encode(text, add_special_tokens=False).ids)
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding (a Mapping)
            ids = ids["input_ids"]
        return list(ids)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return list(prompt)
    return list(tok(prompt or "")["input_ids"])
