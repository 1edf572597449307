"""FastAPI glue for sessions: ``GET/DELETE /v1/sessions/{id}`` and the session headers of a request.

(No ``from __future__ import annotations`` here: FastAPI must evaluate ``Depends(deps.tenant)`` in
the closures below, which string annotations would hide.)

    app.include_router(sessions_router(ctx.sessions, deps))

A request names its session with ``x-session-id`` (created when absent; the router returns it in the
response's ``x-session-id`` header) and chooses how history is used with ``x-tandem-history``:
``client`` (default: the client sends the full history, the router records only what is new) or
``server`` (the client sends only new messages; the router prepends the stored history, see
``prepend_history``; chat completions only). Either way the router records the turn after it ends.
"""

import enum
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, Header, Path, Request, Response

from contracts.errors import InvalidRequest, NotFound
from router.admission.http import AdmissionDependencies
from router.admission.keys import Tenant
from router.edge.openai_errors import error_responses
from router.sessions.models import _ID, conversation, new_session_id, validate_id
from router.sessions.store import SessionStore

HISTORY_HEADER = "x-tandem-history"


class HistoryMode(enum.StrEnum):
    CLIENT = "client"
    SERVER = "server"


@dataclass(frozen=True, slots=True)
class SessionParams:
    session_id: str
    """The named session, a new id in server-history mode when none was named, else ""."""
    created: bool
    """True when the request named no session."""
    mode: HistoryMode


async def session_params(
    x_session_id: Annotated[str | None, Header()] = None,
    x_tandem_history: Annotated[str | None, Header()] = None,
) -> SessionParams:
    """Dependency for completion routes: the request's session id and history mode."""
    # Exactly the documented values (the OpenAPI enum): "Server" or an empty value is a 400, not a guess.
    try:
        mode = HistoryMode("client" if x_tandem_history is None else x_tandem_history)
    except ValueError as exc:
        raise InvalidRequest(f"{HISTORY_HEADER} must be 'client' or 'server'", param=HISTORY_HEADER) from exc
    if x_session_id:
        return SessionParams(validate_id(x_session_id, "x-session-id"), False, mode)
    # Only server-history mode keeps a session the client did not name (router/edge/app.py): an id is made
    # for it alone, not for every nameless request (a uuid4 per request showed in the router's profile).
    return SessionParams(new_session_id() if mode is HistoryMode.SERVER else "", True, mode)


async def prepend_history(
    store: SessionStore, tenant_id: str, session_id: str, new: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Server-history mode: the session's stored conversation (every turn's messages and the assistant's
    answer, tool calls included), then the request's ``new`` messages, as OpenAI message dicts. An
    unknown session has no history, so its first turn is just ``new``. Nothing is trimmed: a
    conversation longer than the context window is refused like any over-long prompt."""
    history = conversation(await store.get_history(tenant_id, session_id))
    return [*msgspec.to_builtins(history), *new]


def sessions_router(store: SessionStore, deps: AdmissionDependencies) -> APIRouter:
    # Errors: 401 before anything else is judged, then the id (400), then whether the tenant has it (404).
    router = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=error_responses(400, 401, 404))

    async def tenant_of(request: Request) -> Tenant:
        # The key is read from the request, not declared as a header parameter: the OpenAPI document
        # names it once, as the bearer security scheme (router/edge/app.py).
        return await deps.tenant(request.headers.get("authorization"))

    # Documented, not validated by FastAPI: ``validate_id`` refuses a malformed id (400) after the key is checked.
    SessionId = Annotated[str, Path(description="A session id", json_schema_extra={"pattern": _ID.pattern})]

    @router.get("/{session_id}")
    async def get_session(session_id: SessionId, tenant: Annotated[Tenant, Depends(tenant_of)]) -> Response:
        turns = await store.get_history(tenant.tenant_id, validate_id(session_id, "session_id"))
        if not turns:
            raise NotFound(f"no session {session_id!r}")
        body = {"id": session_id, "object": "session", "turns": turns, "messages": conversation(turns)}
        return Response(msgspec.json.encode(body), media_type="application/json")

    @router.delete("/{session_id}")
    async def delete_session(session_id: SessionId, tenant: Annotated[Tenant, Depends(tenant_of)]) -> Response:
        if not await store.delete(tenant.tenant_id, validate_id(session_id, "session_id")):
            raise NotFound(f"no session {session_id!r}")
        body = {"id": session_id, "object": "session.deleted", "deleted": True}
        return Response(msgspec.json.encode(body), media_type="application/json")

    return router
