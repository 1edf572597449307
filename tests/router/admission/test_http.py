"""The FastAPI glue through real HTTP semantics (httpx over ASGI): 401, 429 + Retry-After, sessions."""

from typing import Annotated

import httpx
import pytest
from fastapi import Depends, FastAPI, Request

from contracts.errors import TandemError
from router.admission import Admission, Tenant
from router.admission.http import AdmissionDependencies, error_response
from router.sessions import Message, Turn
from router.sessions.http import SessionParams, session_params, sessions_router


@pytest.fixture
def db_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/tandem.db"


def build_app(ctx) -> FastAPI:
    """What the integrator's router does, reduced to the admission parts."""
    app = FastAPI()
    deps = AdmissionDependencies(ctx)

    @app.exception_handler(TandemError)
    async def on_error(_: Request, exc: TandemError):
        return error_response(exc)

    @app.post("/v1/chat/completions")
    async def chat(
        body: dict,
        admission: Annotated[Admission, Depends(deps.admit)],
        session: Annotated[SessionParams, Depends(session_params)],
    ) -> dict:
        await ctx.gate.charge_tokens(admission, prompt_tokens=body["prompt_tokens"], max_tokens=body.get("max_tokens"))
        await ctx.gate.settle(admission, completion_tokens=1)
        if session.session_id:  # a nameless request in client-history mode has no session
            ctx.sessions.record_turn(
                Turn(
                    turn_id=body["turn_id"],
                    session_id=session.session_id,
                    tenant_id=admission.tenant.tenant_id,
                    created_at=1.0,
                    messages=[Message(role="user", content="hi")],
                    response=Message(role="assistant", content="hello"),
                )
            )
        return {
            "tenant": admission.tenant.tenant_id,
            "priority": admission.priority,
            "session": session.session_id,
        }

    @app.get("/v1/models")
    async def models(tenant: Annotated[Tenant, Depends(deps.tenant)]) -> dict:
        return {"tenant": tenant.tenant_id}

    app.include_router(sessions_router(ctx.sessions, deps))
    return app


@pytest.fixture
async def client(ctx):
    transport = httpx.ASGITransport(app=build_app(ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem") as c:
        yield c


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_401_for_missing_unknown_and_revoked_keys(ctx, client):
    assert (await client.get("/v1/models")).json() == {"tenant": "anonymous"}  # no keys yet: auth off
    info, key = await ctx.keys.create_key("acme")
    r = await client.get("/v1/models")
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.json()["error"]["code"] == "missing_api_key"
    assert (await client.get("/v1/models", headers=_auth("tdm-nope"))).status_code == 401
    assert (await client.get("/v1/models", headers=_auth(key))).json() == {"tenant": "acme"}
    await ctx.keys.revoke(info.key_id)
    r = await client.get("/v1/models", headers=_auth(key))
    assert r.status_code == 401 and r.json()["error"]["code"] == "revoked_api_key"


async def test_429_with_retry_after_for_requests_and_tokens(ctx, client, clock):
    _, key = await ctx.keys.create_key("acme", rpm=2, tpm=1000)
    body = {"prompt_tokens": 10, "max_tokens": 10, "turn_id": "t1"}
    assert (await client.post("/v1/chat/completions", json=body, headers=_auth(key))).status_code == 200
    big = {"prompt_tokens": 1000, "max_tokens": 10, "turn_id": "t2"}
    r = await client.post("/v1/chat/completions", json=big, headers=_auth(key))
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert "tokens-per-minute" in r.json()["error"]["message"]
    assert int(r.headers["Retry-After"]) >= 1
    r = await client.post("/v1/chat/completions", json=body, headers=_auth(key))  # 3rd request this minute
    assert r.status_code == 429 and r.headers["Retry-After"] == "30"
    assert "requests-per-minute" in r.json()["error"]["message"]


async def test_priority_header_and_session_header(ctx, client):
    body = {"prompt_tokens": 1, "turn_id": "t1"}
    r = await client.post("/v1/chat/completions", json=body, headers={"x-tandem-priority": "batch"})
    assert r.json()["priority"] == "batch" and r.json()["session"] == ""  # named none: sessionless
    r = await client.post(
        "/v1/chat/completions", json=body, headers={"x-tandem-priority": "batch", "x-tandem-history": "server"}
    )
    assert r.json()["session"].startswith("sess-")  # server-history mode keeps one for the client
    r = await client.post("/v1/chat/completions", json=body, headers={"x-tandem-priority": "urgent"})
    assert r.status_code == 400
    r = await client.post("/v1/chat/completions", json=body, headers={"x-session-id": "bad id!"})
    assert r.status_code == 400


async def test_get_and_delete_session(ctx, client):
    _, key = await ctx.keys.create_key("acme")
    _, other = await ctx.keys.create_key("globex")
    for turn_id in ("t1", "t2"):
        body = {"prompt_tokens": 1, "turn_id": turn_id}
        headers = {**_auth(key), "x-session-id": "s1"}
        assert (await client.post("/v1/chat/completions", json=body, headers=headers)).status_code == 200
    await ctx.sessions.flush()

    r = await client.get("/v1/sessions/s1", headers=_auth(key))
    assert r.status_code == 200
    assert [t["turn_id"] for t in r.json()["turns"]] == ["t1", "t2"]
    assert [m["role"] for m in r.json()["messages"]] == ["user", "assistant", "user", "assistant"]
    assert (await client.get("/v1/sessions/s1", headers=_auth(other))).status_code == 404  # not its session
    assert (await client.get("/v1/sessions/s1")).status_code == 401

    r = await client.delete("/v1/sessions/s1", headers=_auth(key))
    assert r.json() == {"id": "s1", "object": "session.deleted", "deleted": True}
    assert (await client.get("/v1/sessions/s1", headers=_auth(key))).status_code == 404
    assert (await client.delete("/v1/sessions/s1", headers=_auth(key))).status_code == 404
