"""Session-aware retention: which requests ask the host tier to keep their context, for how long, as whose.

Agent sessions pause for tools between turns, seconds to minutes; under cache pressure the engine evicts
their context meanwhile and the next turn computes it again. A request that names a session asks the
node that prefills it to pin the request's blocks in the host tier after it ends: prompt and answer as
far as they fill blocks on a colocated node, the prompt's on a P/D pair (the prefill node's request);
``host_tier.connector``; the tier's side, owners, budgets and demotion, in
``host_tier.server``:

    owner   the request's session (``x-session-id``), else OpenAI's ``prompt_cache_key`` (often shared by
            many conversations, whose pins would replace each other's), prefixed by the tenant, so two
            tenants' keys never meet; neither: no retention
    ttl     the largest ``cache_control.ttl`` among the messages and their content parts (Anthropic's
            ``"5m"`` / ``"1h"``, or seconds as ``"90s"`` / a number), else ``session_retention_s``;
            at most ``session_retention_max_s``
    tenant  whose budget the pins count against (the tier keeps one per tenant)

Each turn replaces the owner's pins, so the blocks of a superseded turn that the new one does not share
(the old tail) are unpinned and demoted: they are the first to leave. The hint travels to the engine in
``kv_transfer_params["tandem_retain"]``, a field only the router sets (``router.edge.schemas.INTERNAL_FIELDS``),
and only to a node whose registry entry names a host tier.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

RETAIN_FIELD = "tandem_retain"
_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")
_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class Retention:
    ttl_s: float
    owner: str
    tenant: str

    def params(self) -> dict[str, Any]:
        return {RETAIN_FIELD: {"ttl_s": self.ttl_s, "owner": self.owner, "tenant": self.tenant}}


def parse_ttl(value: Any) -> float | None:
    """``"5m"``, ``"1h"``, ``"90s"``, ``"300"`` or a number of seconds; None if it is none of those."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value) if value > 0 else None
    if isinstance(value, str):
        m = _TTL.match(value)
        if m:
            return float(m.group(1)) * _UNIT[m.group(2)]
    return None


def _cache_controls(messages: Any) -> Iterable[Any]:
    if not isinstance(messages, list):
        return
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        yield msg.get("cache_control")
        content = msg.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    yield part.get("cache_control")


def retention_default(settings: Any, transport: str) -> float:
    """The TTL a request asks for when its messages name none: ``session_retention_s``; on a WebSocket
    (``router.edge.codecs.websocket``) at least the socket's idle timeout, as the tool pause a socket allows
    is that long and its pins must outlive it. 0 stays 0 (retention off)."""
    default_s: float = settings.session_retention_s
    if transport == "websocket" and default_s > 0:
        return max(default_s, settings.ws_idle_timeout_s)
    return default_s


def retention_for(
    body: dict[str, Any], session_id: str | None, tenant_id: str | None, default_s: float, max_s: float
) -> Retention | None:
    if default_s <= 0 or max_s <= 0:
        return None
    # The session first: OpenAI's prompt_cache_key is often shared by many conversations with a common
    # prefix, and owners replace each other's pins, so it names the owner only for sessionless requests.
    key = body.get("prompt_cache_key")
    name = session_id or (key if isinstance(key, str) and key else None)
    if not name:
        return None
    ttls = [parse_ttl(cc.get("ttl", "5m")) for cc in _cache_controls(body.get("messages")) if isinstance(cc, dict)]
    asked = [t for t in ttls if t is not None]
    ttl = min(max(asked) if asked else default_s, max_s)
    tenant = tenant_id or ""
    return Retention(ttl_s=ttl, owner=f"{tenant}/{name}"[:256], tenant=tenant)
