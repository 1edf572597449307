"""A Redis restart is no outage for clients (issue 12 item 5, issue 13's revocation bound): while the
rate-limit and key Redis is down, keys it confirmed within ``store_outage_grace_s`` (and everyone, if
auth was off that recently, or the key store says it is) are served uncharged; keys nobody can vouch
for get 503 + Retry-After; after the restart everything is charged again. A real redis-server (embedded
binary) is stopped and started again on the same port; the key store is SQLite."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts.errors import StoreError, Unavailable
from infra.redis_server import start_embedded
from router.admission.context import AdmissionContext, AdmissionSettings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Redis:
    def __init__(self, workdir: Path) -> None:
        self.port, self.workdir = _free_port(), workdir
        self.proc = start_embedded(self.port, workdir)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def start(self) -> None:
        self.proc = start_embedded(self.port, self.workdir)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[_Redis]:
    server = _Redis(tmp_path / "redis")
    yield server
    server.stop()


async def _ctx(redis: _Redis, tmp_path: Path, **overrides: object) -> AdmissionContext:
    settings = AdmissionSettings(
        redis_url=redis.url,
        database_url=f"sqlite:///{tmp_path}/keys.db",
        region="a",
        region_cache_urls={},
        redis_socket_timeout_s=0.5,
        redis_connect_timeout_s=0.5,
        **overrides,
    )  # type: ignore[arg-type]
    return await AdmissionContext.create(settings, start_writer=False)


async def test_confirmed_keys_are_served_uncharged_while_redis_restarts(redis_server: _Redis, tmp_path: Path) -> None:
    ctx = await _ctx(redis_server, tmp_path)
    try:
        _, seen = await ctx.keys.create_key("acme", rpm=100, tpm=10_000)
        _, unseen = await ctx.keys.create_key("other", rpm=100, tpm=10_000)
        before = await ctx.gate.admit(f"Bearer {seen}")
        assert before.tenant.tenant_id == "acme" and ctx.gate.charges_tokens(before)

        redis_server.stop()
        during = await ctx.gate.admit(f"Bearer {seen}")
        assert during.tenant.tenant_id == "acme" and during.uncharged and not ctx.gate.charges_tokens(during)
        await ctx.gate.settle(during, 50)  # nothing to settle, and no error
        assert (await ctx.gate.authenticate(f"Bearer {seen}")).tenant_id == "acme"
        for header in (f"Bearer {unseen}", None):  # never confirmed: nobody can vouch for them
            with pytest.raises(Unavailable) as info:
                await ctx.gate.admit(header)
            assert info.value.status_code == 503 and info.value.retry_after > 0
        assert ctx.keys.outage.admissions == 2

        redis_server.start()
        after = await ctx.gate.admit(f"Bearer {unseen}")
        assert after.tenant.tenant_id == "other" and not after.uncharged and ctx.gate.charges_tokens(after)
    finally:
        await ctx.close()


async def test_anonymous_serving_survives_and_grace_zero_refuses_everything(
    redis_server: _Redis, tmp_path: Path
) -> None:
    ctx = await _ctx(redis_server, tmp_path)
    strict = await _ctx(redis_server, tmp_path / "strict", store_outage_grace_s=0)
    try:
        assert (await ctx.gate.admit(None)).tenant.tenant_id == "anonymous"
        assert (await strict.gate.admit(None)).tenant.tenant_id == "anonymous"
        redis_server.stop()
        assert (await ctx.gate.admit(None)).uncharged
        with pytest.raises(Unavailable):
            await strict.gate.admit(None)
    finally:
        await ctx.close()
        await strict.close()


async def test_a_router_that_served_nobody_asks_the_key_store_whether_auth_is_off(
    redis_server: _Redis, tmp_path: Path
) -> None:
    """No request within the grace (here: none since start), then Redis goes away: the key store itself
    says whether anyone may be served. No key: anonymous, uncharged. Keys exist: 503, and auth stays on."""
    open_store = await _ctx(redis_server, tmp_path / "open")
    keyed_store = await _ctx(redis_server, tmp_path / "keyed")
    strict = await _ctx(redis_server, tmp_path / "strict", store_outage_grace_s=0)
    await keyed_store.keys.create_key("acme", rpm=100, tpm=10_000)
    fresh = await _ctx(redis_server, tmp_path / "keyed")  # another router on that store, never asked
    try:
        redis_server.stop()
        admitted = await open_store.gate.admit(None)
        assert admitted.tenant.tenant_id == "anonymous" and admitted.uncharged
        for ctx in (fresh, strict):
            with pytest.raises(Unavailable):
                await ctx.gate.admit(None)
        assert fresh.keys.auth_args(None)[1][0] == "1", "the store's keys turned auth on for good"
    finally:
        for ctx in (open_store, keyed_store, strict, fresh):
            await ctx.close()


async def test_an_unreachable_key_store_is_asked_once_per_check_period(
    redis_server: _Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests at once share one ask; the ones after a failed ask, within the check period, ask nothing."""
    ctx = await _ctx(redis_server, tmp_path)
    asked: list[str] = []
    answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    vouching, all_vouching = 0, asyncio.Event()
    during = ctx.keys.outage.during

    def counted(authorization: str | None) -> object:
        nonlocal vouching
        vouching += 1
        if vouching == 3:
            all_vouching.set()
        return during(authorization)

    async def unreachable(sql: str, *args: object) -> list:
        asked.append(sql)
        await answer
        raise StoreError("the key store is down too")

    try:
        monkeypatch.setattr(ctx.keys._db, "fetch", unreachable)
        monkeypatch.setattr(ctx.keys.outage, "during", counted)
        redis_server.stop()
        at_once = [asyncio.ensure_future(ctx.gate.admit(None)) for _ in range(3)]
        # All three met the outage and went on to the store's ask (or joined it): it has not answered yet.
        await asyncio.wait_for(all_vouching.wait(), 10)
        answer.set_result(None)
        for outcome in await asyncio.gather(*at_once, return_exceptions=True):
            assert isinstance(outcome, Unavailable), outcome
        for _ in range(3):
            with pytest.raises(Unavailable):
                await ctx.gate.admit(None)
        assert len(asked) == 1, asked
    finally:
        await ctx.close()
