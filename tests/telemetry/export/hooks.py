"""Redaction hooks the export tests name in ``TANDEM_EXPORT_REDACT``."""

from __future__ import annotations

import re
from typing import Any

SECRET = re.compile(r"SECRET-[A-Za-z0-9]+")


def mask_secrets(example: dict[str, Any]) -> dict[str, Any] | None:
    """Mask ``SECRET-...`` in every text; leave out examples that say ``DROP-ME``."""
    for m in example["messages"]:
        if isinstance(m.get("content"), str):
            if "DROP-ME" in m["content"]:
                return None
            m["content"] = SECRET.sub("[redacted]", m["content"])
    example["metadata"]["redacted"] = True
    return example


def broken(example: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("hook bug")
