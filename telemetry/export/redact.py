"""The redaction hook: a Python callable the operator names in the settings (``TANDEM_EXPORT_REDACT=
module:function``), applied to every example before anything is written or counted as exported.

It receives one example in the chat shape, ``{"messages": [...OpenAI messages...], "metadata": {...}}``
(a fresh copy: it may change it in place), and returns the example to write or None to leave it out
(counted as ``redacted_out``). Anything else it returns, or any exception it raises, stops the export
before that example's part is written: a hook that fails must not let unredacted text through.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from typing import Any

from contracts.errors import ConfigError

Record = dict[str, Any]
Hook = Callable[[Record], Record | None]


class RedactionError(ConfigError):
    """The hook failed or returned something that is not an example."""


def load_hook(spec: str | None) -> Hook | None:
    """The callable ``spec`` (``package.module:function``) names; None for None."""
    if not spec:
        return None
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"redaction hook {spec!r}: want module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"redaction hook {spec!r}: cannot import {module_name}: {exc}") from exc
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"redaction hook {spec!r}: {module_name} has no {attr}")
    if not callable(fn):
        raise ConfigError(f"redaction hook {spec!r} is not callable")
    hook: Hook = fn
    return hook


def apply(hook: Hook | None, record: Record) -> Record | None:
    if hook is None:
        return record
    try:
        out = hook(copy.deepcopy(record))
    except Exception as exc:  # noqa: BLE001 - any failure of operator code stops the export, named
        raise RedactionError(f"redaction hook failed on {record['metadata'].get('request_id')}: {exc!r}") from exc
    if out is None:
        return None
    if not isinstance(out, dict) or not isinstance(out.get("messages"), list):
        raise RedactionError(f"redaction hook returned {type(out).__name__}, not an example with messages")
    return out
