"""A deadline for rendering a chat template in the router.

A Jinja template is a program: the model's own, or a client's where the operator trusts them, can loop
long over a request (``range`` nests, loops over the messages). A thread cannot be killed, so the
deadline is checked from inside the rendering: the sandbox that transformers compiles every chat
template in routes every call (``range`` included), attribute and item access of the template
through its environment's ``call``, ``getattr`` and ``getitem``; those three are wrapped, on the very
environment of the compiled template transformers will use (its compile cache is keyed by the
template's text), to raise ``RenderTimeout`` once the deadline set for this rendering has passed.

What this bounds: every loop whose body (or whose next iteration) calls a function or reads an
attribute or item, which is any loop that renders something of the request; a loop of loops over
``range`` (each inner ``range`` is a call). What it does not: a loop whose innermost level touches
nothing of that kind (``{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}`` over a local ``s``),
which no chat template needs; and memory: a template that repeats a long message many times within
the deadline builds its output in full. Only the rendering is bounded, not the encoding that follows
(linear in the rendered text, which the body limit bounds).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("tandem.router.tokenizer")

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("tandem_template_deadline", default=None)
_lock = threading.Lock()


class RenderTimeout(Exception):
    """Rendering passed its deadline (raised inside the template's own code, so the thread ends)."""


def check_deadline() -> None:
    deadline = _DEADLINE.get()
    if deadline is not None and time.monotonic() > deadline:
        raise RenderTimeout


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Bound the renderings done in this context (this thread or task) to ``seconds`` from now."""
    token = _DEADLINE.set(None if seconds is None or seconds <= 0 else time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check_deadline()
        return fn(*args, **kwargs)

    return wrapper


def bound_environment(env: Any) -> None:
    """Make ``env`` (a Jinja sandboxed environment) check the deadline on every call, attribute and item
    access of the templates compiled in it. Idempotent. The wrappers are set on the instance, where
    the compiled template code looks them up (``environment.call(context, ...)``)."""
    if getattr(env, "_tandem_deadline", False):
        return
    with _lock:
        if getattr(env, "_tandem_deadline", False):
            return
        env.call, env.getattr, env.getitem = _checked(env.call), _checked(env.getattr), _checked(env.getitem)
        env._tandem_deadline = True


def bound_template(tok: Any, chat_template: str | None, tools: Any) -> None:
    """Bound the compiled template that ``tok.apply_chat_template(chat_template=..., tools=...)`` will
    render (transformers' compile cache: the same object for the same text)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        text = tok.get_chat_template(chat_template, tools)
        bound_environment(_compile_jinja_template(text).environment)
    except (ImportError, AttributeError) as exc:  # another transformers: the outer wait still bounds
        log.warning("cannot put a deadline inside chat-template rendering (%s)", exc)
