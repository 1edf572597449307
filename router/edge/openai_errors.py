"""The edge: Tandem errors (``contracts.errors``) to OpenAI-format HTTP error responses.

OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``. 429 and 503 carry Retry-After.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from contracts.errors import RateLimited, TandemError, Unavailable

log = logging.getLogger("tandem.router")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape, as every route of the router answers an error (the OpenAPI document's
    schema for every 4xx/5xx it lists)."""

    error: ErrorDetail


ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, too deep, too many or too large messages, a refused field or header",
    401: "No API key, or an unknown or revoked one (once auth is on)",
    403: "The key may not do this (an admin route, or a route-forcing header)",
    404: "No such model, response or session (or another tenant's)",
    413: "The body is over the router's size limit",
    422: "The body or a parameter does not match the request schema",
    429: "Over the key's request or token rate (Retry-After says when to retry)",
    502: "An engine failed or answered with an error",
    503: "No capacity in time, or no serving node (Retry-After says when to retry)",
}


ERROR_REF = f"#/components/schemas/{ErrorBody.__name__}"
"""Every error response's schema; ``document_error_schema`` puts ``ErrorBody`` into the document."""


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses (FastAPI's ``responses=``) for the error statuses a route can answer: JSON
    ``ErrorBody`` whatever the route's own media type."""
    return {
        code: {
            "description": ERROR_DESCRIPTIONS[code],
            "content": {"application/json": {"schema": {"$ref": ERROR_REF}}},
        }
        for code in codes
    }


def document_error_schema(schema: dict[str, Any]) -> None:
    """Add ``ErrorBody`` (and what it refers to) to an OpenAPI document's components."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components[ErrorBody.__name__] = error_schema


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_from_exception(exc: TandemError) -> dict:
    return error_body(exc.message, exc.error_type, param=exc.param, code=exc.code)


def response_for(exc: TandemError) -> JSONResponse:
    headers = {}
    if isinstance(exc, RateLimited | Unavailable):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return JSONResponse(error_from_exception(exc), status_code=exc.status_code, headers=headers)


def allowed_methods(request: Request) -> str:
    """A 405's ``Allow``: the methods of every route at the request's path. (Starlette names only the
    first route that matched the path, and GET and DELETE /v1/sessions/{id} are two routes.)"""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TandemError)
    async def _tandem(_: Request, exc: TandemError) -> JSONResponse:
        if exc.status_code >= 500:
            log.warning("request failed: %s: %s", type(exc).__name__, exc.message)
        return response_for(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(
            error_body(msg, "invalid_request_error", param=".".join(loc) or None, code="invalid_value"), status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = allowed_methods(request)
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body("internal error", "server_error"), status_code=500)
