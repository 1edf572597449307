"""The router's OpenAPI document and its viewers (``/openapi.json``, ``/docs``, ``/redoc``), under the
API's own auth rule: once auth is on they need a key like every route but ``/health``, and the document
says so; while auth is off it says the key is optional, which is then what the server does.

What FastAPI cannot infer is added here (``document_api``): the bearer key per route, the feedback body
(read by ``parse_body``, not FastAPI, so that the edge's limits apply first), the links a stateful client
follows; the generation routes, plain ASGI apps FastAPI cannot see, come from ``router.edge.exchange``.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from router.admission.keys import Tenant
from router.edge.exchange import document_generation_routes

BEARER = "apiKey"
"""The OpenAPI security scheme: ``Authorization: Bearer <key>``, needed on every route but ``/health``
once auth is on."""


def document_open_api(schema: dict[str, Any]) -> dict[str, Any]:
    """The document as it stands while auth is off: the same API, the bearer key optional (OpenAPI's
    empty requirement, ``{}``, beside the scheme). Served then because it is then true: no key is
    needed, and a client that sends one is served all the same."""
    opened = copy.deepcopy(schema)
    for path, operations in opened["paths"].items():
        for operation in operations.values():
            if path != "/health":
                operation["security"] = [{BEARER: []}, {}]
    opened["components"]["securitySchemes"][BEARER]["description"] += (
        "; optional while no key exists (auth off: this document is then served with the key optional)"
    )
    return opened


def document_api(schema: dict[str, Any], feedback_model: type[BaseModel]) -> dict[str, Any]:
    """What FastAPI cannot infer: the bearer key on every route but ``/health``, and the feedback body
    (read by ``parse_body``, not by FastAPI, so that the edge's limits apply first)."""
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})[BEARER] = {
        "type": "http",
        "scheme": "bearer",
        "description": "A Tandem API key (`tandem keys create`); admin keys for /metrics and /cluster",
    }
    name = feedback_model.__name__
    components.setdefault("schemas", {})[name] = feedback_model.model_json_schema(
        ref_template="#/components/schemas/{model}"
    )
    schema["paths"]["/v1/feedback"]["post"]["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            operation["security"] = [] if path == "/health" else [{BEARER: []}]
    # Links: what one answer lets a client do next (and what schemathesis's stateful run follows).
    paths = schema["paths"]
    get_session, delete_session = (
        paths["/v1/sessions/{session_id}"]["get"],
        paths["/v1/sessions/{session_id}"]["delete"],
    )
    by_session = {"session_id": "$response.header.x-session-id"}
    for path in ("/v1/chat/completions", "/v1/completions"):
        paths[path]["post"]["responses"]["200"]["links"] = {
            "GetSession": {"operationId": get_session["operationId"], "parameters": by_session},
            "DeleteSession": {"operationId": delete_session["operationId"], "parameters": by_session},
            "Feedback": {
                "operationId": paths["/v1/feedback"]["post"]["operationId"],
                "requestBody": {"response_id": "$response.body#/id", "rating": 1},
            },
        }
    same_session = {"session_id": "$request.path.session_id"}
    get_session["responses"]["200"]["links"] = {
        "DeleteSession": {"operationId": delete_session["operationId"], "parameters": same_session}
    }
    delete_session["responses"]["200"]["links"] = {
        "GetSession": {"operationId": get_session["operationId"], "parameters": same_session}
    }
    return schema


def install_document(
    app: FastAPI, tenant_of: Callable[[Request], Awaitable[Tenant]], feedback_model: type[BaseModel]
) -> None:
    """The document builder (once, on first use) and the three routes that serve it."""
    router = APIRouter()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document_api(
                document_generation_routes(get_openapi(title=app.title, version=app.version, routes=app.routes)),
                feedback_model,
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    open_document: dict[str, Any] = {}

    @router.get("/openapi.json", include_in_schema=False)
    async def openapi_document(request: Request) -> JSONResponse:
        """Needs a key once auth is on, as every route but ``/health``; a tenant without a key is what auth
        off (or a store outage while it was off) admits, and gets the document with the key optional."""
        if (await tenant_of(request)).key_id is not None:
            return JSONResponse(app.openapi())
        if not open_document:
            open_document.update(document_open_api(app.openapi()))
        return JSONResponse(open_document)

    @router.get("/docs", include_in_schema=False)
    async def swagger(request: Request) -> Response:
        await tenant_of(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    @router.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> Response:
        await tenant_of(request)
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    app.include_router(router)
