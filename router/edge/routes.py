"""The router's own routes beside generation: feedback, the model list, health, the cluster view and the
Prometheus exposition. Each gets the process's ``Services`` through the typed dependency
``services_of``; the admin views (``/cluster``, ``/metrics``) need an admin key once auth is on."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from contracts.errors import NotFound, PermissionDenied
from contracts.registry import LiveNode, Role
from router.admission.keys import Tenant
from router.edge.exchange import parse_body
from router.edge.openai_errors import error_responses
from router.edge.schemas import JsonInt
from router.edge.services import Services, services_of

Svc = Annotated[Services, Depends(services_of)]


class Feedback(BaseModel):
    """Bounded: feedback is stored with the request's record; a comment is a remark, not a document."""

    response_id: str = Field(min_length=1, max_length=128)
    rating: JsonInt = Field(ge=-1_000_000, le=1_000_000)
    comment: str | None = Field(default=None, max_length=4096)
    labels: list[Annotated[str, Field(max_length=64)]] = Field(default_factory=list, max_length=32)


class FeedbackRecorded(BaseModel):
    object: Literal["feedback"]
    response_id: str
    status: Literal["recorded"]


class Health(BaseModel):
    status: Literal["ok", "no_nodes"]
    nodes: dict[str, int]


async def tenant_of(request: Request, *, admin: bool = False) -> Tenant:
    """The request's tenant (401 while auth is on and the key is missing or bad); with ``admin``, 403
    unless the key is an admin key (or auth is off)."""
    tenant = await services_of(request).admission.gate.authenticate(request.headers.get("authorization"))
    if admin and not tenant.may_administer:
        raise PermissionDenied("this route needs an admin key (`tandem keys create --admin`)")
    return tenant


router = APIRouter()


@router.post(
    "/v1/feedback",
    status_code=202,
    responses={
        202: {"model": FeedbackRecorded, "description": "Recorded with the response's record"},
        **error_responses(400, 401, 404, 413, 422),
    },
)
async def feedback(request: Request, svc: Svc) -> JSONResponse:
    tenant = await tenant_of(request)
    fb: Feedback = await parse_body(request, Feedback)
    ref = await svc.responses.lookup(fb.response_id)
    if ref.tenant_id != tenant.tenant_id:
        # As if it did not exist: another tenant's response ids are not even confirmed.
        raise NotFound(f"No response with id `{fb.response_id}`.", param="response_id")
    if svc.emitter is not None:
        svc.emitter.emit(
            "feedback",
            {
                "response_id": fb.response_id,
                "request_id": ref.request_id,
                "session_id": ref.session_id,
                "tenant_id": ref.tenant_id,
                "rating": fb.rating,
                "comment": fb.comment,
                "labels": fb.labels,
            },
        )
    return JSONResponse({"object": "feedback", "response_id": fb.response_id, "status": "recorded"}, status_code=202)


def _card(name: str, n: LiveNode, parent: str | None) -> dict[str, Any]:
    started = datetime.fromtimestamp(n.info.started_at, tz=UTC)
    return {
        "id": name,
        "object": "model",
        # Anthropic's model card too (Claude Code lists models with the anthropic SDK).
        "type": "model",
        "display_name": name,
        "created_at": started.isoformat().replace("+00:00", "Z"),
        "created": int(n.info.started_at),
        "owned_by": "tandem",
        "root": n.info.model,
        "parent": parent,
        "max_model_len": n.info.max_model_len,
    }


@router.get("/v1/models", responses=error_responses(401))
async def models(request: Request, svc: Svc) -> dict[str, Any]:
    """Every served model with a live node, then every alias and canary name (``router.model_table``)
    one of whose served models has a live node; ``parent`` names what a public name stands for (an
    alias's target, a canary's heaviest served name; vLLM's field for a model built on another), null
    for a served model."""
    await tenant_of(request)
    served = svc.fleet.models()
    data = [_card(name, n, None) for name, n in sorted(served.items())]
    for public in svc.models.public_names:
        live = [t for t in svc.models.targets(public) if t in served]
        if live and public not in served:
            data.append(_card(public, served[live[0]], svc.models.parent(public)))
    # OpenAI's list, with Anthropic's paging fields (one page holds every model).
    return {
        "object": "list",
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


@router.get(
    "/health",
    response_model=Health,
    responses={503: {"model": Health, "description": "No node can serve (none is live)"}},
)
async def health(svc: Svc) -> JSONResponse:
    roles = {r.value: sum(1 for n in svc.fleet.nodes if n.info.role is r) for r in Role}
    serving = any(roles.values())  # with every decode node gone, prefill nodes serve whole requests
    return JSONResponse(
        {"status": "ok" if serving else "no_nodes", "nodes": roles}, status_code=200 if serving else 503
    )


@router.get("/cluster", responses=error_responses(401, 403))
async def cluster(request: Request, svc: Svc) -> dict[str, Any]:
    """Admin view: every live node with its role, load, KV usage, cached blocks in the router's index
    and its KV-event stream health."""
    await tenant_of(request, admin=True)
    fleet = svc.fleet
    blocks = {node: n for per_model in svc.index.block_counts().values() for node, n in per_model.items()}
    events = svc.subscribers.stats()
    nodes = []
    for n in sorted(fleet.nodes, key=lambda n: (n.info.role.value, n.info.node_id)):
        st = events.get(n.info.node_id)
        nodes.append(
            {
                "node_id": n.info.node_id,
                "role": n.info.role.value,
                "model": n.info.model,
                "url": n.info.url,
                "running": n.load.running,
                "waiting": n.load.waiting,
                "kv_usage": n.load.kv_usage,
                "num_kv_blocks": n.info.num_kv_blocks,
                "block_size": n.info.block_size,
                "cached_blocks": blocks.get(n.info.node_id, 0),
                "router_inflight": fleet.inflight(n.info.node_id),
                "kv_events": {
                    "applied_batches": st.applied_batches,
                    "gaps": st.gaps,
                    "lost": st.lost,
                    "key_mismatches": st.key_mismatches,
                }
                if st
                else None,
            }
        )
    settings = svc.settings
    return {"object": "cluster", "cluster": settings.cluster, "policy": settings.policy, "nodes": nodes}


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text exposition format"}, **error_responses(401, 403)},
)
async def prometheus(request: Request, svc: Svc) -> Response:
    await tenant_of(request, admin=True)
    fleet, metrics = svc.fleet, svc.metrics
    metrics.live_nodes.clear()
    for role in Role:
        metrics.live_nodes.labels(role.value).set(sum(1 for n in fleet.nodes if n.info.role is role))
    for n in fleet.nodes:
        labels = (n.info.node_id, n.info.role.value)
        metrics.inflight.labels(*labels).set(fleet.inflight(n.info.node_id))
        metrics.kv_usage.labels(*labels).set(n.load.kv_usage)
        metrics.common.set_node_load(*labels, waiting=n.load.waiting, running=n.load.running)
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
