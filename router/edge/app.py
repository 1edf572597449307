"""The router's HTTP edge: OpenAI-compatible API over FastAPI, SSE streaming, errors in OpenAI's shape.

    POST /v1/chat/completions   POST /v1/completions   (stream and non-stream)
    POST /v1/responses          POST /v1/messages      (the same path, decoded and encoded by router.edge.codecs)
    GET|DELETE /v1/responses/{id}   POST /v1/responses/{id}/cancel   GET /v1/responses/{id}/input_items
    POST /v1/messages/count_tokens
    GET  /v1/models             GET  /health           GET  /metrics          GET /cluster
    POST /v1/feedback

Once auth is on (a key exists, or ``TANDEM_AUTH=required``), every route but ``/health`` needs a key
(``/openapi.json``, ``/docs`` and ``/redoc`` included, and the document then says so; while auth is off
it says the key is optional, which is what the server does);
``/metrics`` and ``/cluster`` (node URLs, load) need an admin key (403 otherwise); feedback is accepted
only from the tenant that owns the response (another's → 404, as if it did not exist). Bodies are
bounded before they are read (``router.edge.limits``: 413, then JSON depth, message count and size: 400).

Admission on every generation route, in this order: auth + requests/min (401, 429), body checks,
session and history headers, tokens/min after tokenizing (429), then a slot on each chosen node, queued
by class (the key's, lowered by ``x-tandem-priority``) until the deadline (``x-tandem-deadline-ms`` or
``TANDEM_REQUEST_DEADLINE_S``): shed → 503 + Retry-After, code ``overloaded``/``shed``; expired → 503 +
Retry-After, code ``deadline_exceeded``, and no engine ever saw the request.

A client that disconnects cancels its request everywhere: one ``router.edge.exchange.Exchange`` owns each
generation request from admission to its record, and lets go of everything it held exactly once.

Wiring: ``create_app`` only wires routes. The app's lifespan is ``open_services`` (``router.edge.services``):
every resource opened on one exit stack and closed in reverse, whatever fails; the routes reach the
open ``Services`` through the typed dependency ``services_of`` (the generation routes, plain ASGI apps,
through the same function), never through attributes looked up by name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from router.admission.http import AdmissionDependencies
from router.edge import routes
from router.edge.api_document import install_document
from router.edge.codecs.routes import agent_router
from router.edge.exchange import GenerationRoute
from router.edge.limits import BodyLimit
from router.edge.openai_errors import install_error_handlers
from router.edge.services import RouterApp, open_services
from router.sessions.http import sessions_router
from router.settings import RouterSettings


def create_app(settings: RouterSettings | None = None) -> RouterApp:
    """The router's app for ``settings`` (None: from the environment); its services open with its
    lifespan. The document and its viewers are routes of ours, not FastAPI's open ones: they follow the
    API's own auth rule, and the document says what the server does in the auth mode it is in."""
    settings = settings or RouterSettings()

    @asynccontextmanager
    async def lifespan(app: RouterApp) -> AsyncIterator[None]:
        async with open_services(settings) as services:
            app.serve_with(services)
            # The session routes take the admission's session store itself (router.sessions.http).
            app.include_router(sessions_router(services.admission.sessions, AdmissionDependencies(services.admission)))
            yield

    app = RouterApp(
        title="Tandem router", version="0.1.0", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None
    )
    install_error_handlers(app)
    app.add_middleware(BodyLimit, **BodyLimit.settings_of(settings))
    # The generation routes are plain ASGI apps: each request is one ``Exchange`` that owns its whole
    # life, the sending of the answer included (router.edge.exchange).
    app.router.add_route("/v1/chat/completions", GenerationRoute("chat", "chat"), methods=["POST"])
    app.router.add_route("/v1/completions", GenerationRoute("completion", "completions"), methods=["POST"])
    # Responses and Messages: decoded at the edge into the same chat request (router.edge.codecs.intake).
    app.router.add_route("/v1/responses", GenerationRoute("chat", "responses", "responses"), methods=["POST"])
    app.router.add_route("/v1/messages", GenerationRoute("chat", "messages", "messages"), methods=["POST"])
    app.include_router(agent_router())
    install_document(app, routes.tenant_of, routes.Feedback)
    app.include_router(routes.router)
    return app
