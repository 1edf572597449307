"""The engine answers only its cluster: every HTTP and WebSocket path but a health probe and the
metrics needs the engine key.

vLLM's own key check (``VLLM_API_KEY``) guards ``/v1`` and a few other prefixes only; ``/invocations``
(always registered) runs chat and completions with a caller's body, ``kv_transfer_params`` and
``cache_salt`` included, and ``/tokenize``, ``/kv_event_sources``, ``/load``, ``/version`` and the
rest are open. So the node agent loads this middleware into its engine with vLLM's ``--middleware``
(``node_agent.node.engine_command``) whenever it gives the engine a key: the default is to refuse,
and the open paths are named one by one.

Open: ``/health`` and ``/ping`` (liveness, nothing in them) and ``/metrics`` (aggregate counters,
no prompt or token content; Prometheus scrapes it without the cluster's secret). A refused HTTP
request gets 401 in the OpenAI error shape; a refused WebSocket is closed before it is accepted
(the server answers 403).

It runs inside the engine process, so it imports nothing of ours: the key comes from the same
environment variable vLLM reads, and it compares SHA-256 digests in constant time, as vLLM does.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})
KEY_ENV = "VLLM_API_KEY"

_REFUSAL = json.dumps(
    {
        "error": {
            "message": "this engine serves its cluster's router and node agent only: send the engine key",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class EngineGuard:
    """Pure ASGI middleware: refuse every request that is not to an open path and lacks the key."""

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        self.app = app
        key = key if key is not None else os.environ.get(KEY_ENV, "")
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    def allows(self, scope: Scope) -> bool:
        if self._digest is None or scope.get("path") in OPEN_PATHS or scope.get("method") == "OPTIONS":
            return True
        token = _bearer(scope)
        return token is not None and hmac.compare_digest(hashlib.sha256(token).digest(), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allows(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(_REFUSAL)).encode())]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": _REFUSAL})
