"""The edge: Tandem errors (``contracts.errors``) to OpenAI-format HTTP error responses.

OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``. 429 and 503 carry Retry-After.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from contracts.errors import RateLimited, TandemError, Unavailable

log = logging.getLogger("tandem.router")


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_from_exception(exc: TandemError) -> dict:
    return error_body(exc.message, exc.error_type, param=exc.param, code=exc.code)


def response_for(exc: TandemError) -> JSONResponse:
    headers = {}
    if isinstance(exc, RateLimited | Unavailable):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return JSONResponse(error_from_exception(exc), status_code=exc.status_code, headers=headers)


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
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body("internal error", "server_error"), status_code=500)
