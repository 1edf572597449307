"""FastAPI glue for admission: dependencies the router puts on its ``/v1`` routes.

    deps = AdmissionDependencies(ctx)
    @app.post("/v1/chat/completions")
    async def chat(body: ..., admission: Admission = Depends(deps.admit)): ...
    @app.get("/v1/models")
    async def models(tenant: Tenant = Depends(deps.tenant)): ...

Errors are raised as ``contracts.errors`` types; ``error_response`` renders one in OpenAI's shape with
``Retry-After`` for 429/503, for a router whose own handler does not do that yet.
"""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import Header
from fastapi.responses import JSONResponse

from contracts.errors import RateLimited, TandemError, Unavailable
from router.admission.context import AdmissionContext
from router.admission.keys import Tenant
from router.admission.ratelimit import Admission


class AdmissionDependencies:
    """``Depends`` targets bound to one ``AdmissionContext``."""

    def __init__(self, ctx: AdmissionContext) -> None:
        self.ctx = ctx

    async def tenant(self, authorization: Annotated[str | None, Header()] = None) -> Tenant:
        """Authentication only (401 on a missing, unknown or revoked key while auth is on)."""
        return await self.ctx.gate.authenticate(authorization)

    async def admit(
        self,
        authorization: Annotated[str | None, Header()] = None,
        x_tandem_priority: Annotated[str | None, Header()] = None,
    ) -> Admission:
        """Authentication + one request charged against requests/min (401, 429, 400 on a bad priority
        header). The router then calls ``ctx.gate.charge_tokens(admission, prompt_tokens, max_tokens)``
        once it has tokenized, and ``ctx.gate.settle(admission, completion_tokens)`` at the end."""
        return await self.ctx.gate.admit(authorization, priority_header=x_tandem_priority)


def retry_after_headers(exc: TandemError) -> dict[str, str]:
    if isinstance(exc, RateLimited | Unavailable):
        return {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
    return {}


def error_response(exc: TandemError) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}}
    return JSONResponse(body, status_code=exc.status_code, headers=retry_after_headers(exc))
