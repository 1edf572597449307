"""The Responses and Messages routes that are not generation: stored responses, and counting tokens.

    GET    /v1/responses/{id}              the stored Response object (tenant-scoped: another's is a 404)
    POST   /v1/responses/{id}/cancel       a stored response has finished: answered as it is
    DELETE /v1/responses/{id}              forget it (the chain through it ends there)
    GET    /v1/responses/{id}/input_items  its input, as Responses items
    POST   /v1/messages/count_tokens       the prompt's tokens as the engine's chat template renders it

The generation routes themselves (``POST /v1/responses``, ``POST /v1/messages``) are the cluster's one
generation path (``router.edge.exchange`` with ``router.edge.codecs.intake``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from contracts.errors import InvalidRequest, ModelNotFound, TandemError
from router.admission.keys import Tenant
from router.edge.codecs.intake import check_schema, decode_body, error_response
from router.edge.codecs.internal import Message, to_chat_body
from router.edge.codecs.store import ResponseStore
from router.edge.codecs.websocket import socket_router
from router.edge.limits import parse_json
from router.edge.openai_errors import error_responses


async def _tenant(request: Request) -> Tenant:
    authorization = request.headers.get("authorization")
    if authorization is None and request.headers.get("x-api-key"):
        authorization = f"Bearer {request.headers['x-api-key']}"
    tenant: Tenant = await request.app.state.admission.gate.authenticate(authorization)
    return tenant


def _input_item(i: int, m: Message) -> list[dict[str, Any]]:
    if m.role == "tool":
        return [{"id": f"fco_{i}", "type": "function_call_output", "call_id": m.tool_call_id, "output": m.text}]
    items: list[dict[str, Any]] = []
    if m.text or not m.tool_calls:
        kind = "output_text" if m.role == "assistant" else "input_text"
        items.append(
            {
                "id": f"msg_{i}",
                "type": "message",
                "role": m.role,
                "status": "completed",
                "content": [{"type": kind, "text": m.text}],
            }
        )
    for j, c in enumerate(m.tool_calls):
        items.append(
            {
                "id": f"fc_{i}_{j}",
                "type": "function_call",
                "call_id": c.id,
                "name": c.name,
                "arguments": c.arguments,
                "status": "completed",
            }
        )
    return items


def agent_router() -> APIRouter:
    router = APIRouter()
    router.include_router(socket_router())  # GET /v1/responses and /v1/chat/completions as WebSockets
    errors = error_responses(401, 404)

    def store(request: Request) -> ResponseStore:
        s: ResponseStore = request.app.state.response_store
        return s

    @router.get("/v1/responses/{response_id}", responses=errors)
    async def get_response(request: Request, response_id: str) -> dict[str, Any]:
        tenant = await _tenant(request)
        return (await store(request).load(tenant.tenant_id, response_id)).response

    @router.post("/v1/responses/{response_id}/cancel", responses=errors)
    async def cancel_response(request: Request, response_id: str) -> dict[str, Any]:
        """Responses run in the foreground here: by the time a client can name one it has finished, so
        cancelling answers it as it is (a running one is cancelled by closing its stream)."""
        tenant = await _tenant(request)
        return (await store(request).load(tenant.tenant_id, response_id)).response

    @router.delete("/v1/responses/{response_id}", responses=errors)
    async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
        tenant = await _tenant(request)
        await store(request).delete(tenant.tenant_id, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @router.get("/v1/responses/{response_id}/input_items", responses=errors)
    async def input_items(request: Request, response_id: str) -> dict[str, Any]:
        tenant = await _tenant(request)
        stored = await store(request).load(tenant.tenant_id, response_id)
        data = [item for i, m in enumerate(stored.messages[: stored.input_count]) for item in _input_item(i, m)]
        data.reverse()  # OpenAI lists them newest first by default (order=desc)
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": False,
        }

    @router.post("/v1/messages/count_tokens", responses=error_responses(400, 401, 404, 413))
    async def count_tokens(request: Request) -> JSONResponse:
        try:
            await _tenant(request)
            settings = request.app.state.settings
            body = parse_json(await request.body(), settings.max_json_depth, settings.max_json_containers)
            check_schema("count_tokens", body)
            body = {**body, "max_tokens": 1, "stream": False}
            internal = decode_body("messages", body, {})
            served = request.app.state.fleet.models()
            node = served.get(internal.model)
            if node is None:
                raise ModelNotFound(f"model: {internal.model}", param="model")
            ids = await request.app.state.orchestrator.tokenizer.token_ids(node.info, to_chat_body(internal))
            if ids is None:
                raise InvalidRequest("this model's tokenizer is not available to the router", param="model")
            return JSONResponse({"input_tokens": len(ids)})
        except TandemError as exc:
            return error_response("messages", exc)

    return router
