"""Two regions, one lost mid-session (issue 38, the region failover acceptance): ``tests/lab/regions.py``
builds them, each with its own router, node and Redis, over one PostgreSQL store (primary in region a,
streaming replica in region b).

A session of five turns in server-history mode (the client sends only each turn's new message; the
router prepends the stored history). Turns 1-3 go through region a's router. Their turns reach region
b's replica within the replication lag, measured. Region a is then lost (its hosts cut, then its
processes killed), the operator promotes region b's replica, and the client, whose request to region a
fails, repeats it against region b's URL with the same ``openai`` SDK, as its retry would with a list of
base URLs. Turns 4-5 are answered in region b with the whole history: the engine's prompt was the
whole conversation (the same prompt-token count and greedy answer as a stateless request carrying
turns 1-3 in full; without the history both differ), and region b's cache was refilled from the store.
No turn is lost: region a's store held 3 when it was lost, region b's holds 5, and so does its cache.

The store-only test runs the same PostgreSQL failover without engines (no ``e2e`` mark): the session
store of a router in region b reads what region a wrote, through its replica once region a is gone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest
import redis

from contracts.cluster import DEFAULT_CLUSTER
from contracts.cluster import prefix as cluster_prefix
from router.admission.keys import ANONYMOUS_TENANT
from router.sessions import RegionCache, SessionStore, Turn, open_database
from router.sessions.models import Message
from router.sessions.store import MARKER
from tests.lab.regions import FAILOVER_S, RegionsCluster, regions_cluster
from tests.support.helpers import wait_for

SESSION = "sess-region-failover"
TURNS = [
    "My name is Ada and my code word is PELICAN. Say hello.",
    "What is two plus two?",
    "Name a colour of the sky.",
    "What is my code word?",
    "Thank you, goodbye.",
]
MAX_TOKENS = 12
LOST_AFTER = 3
REGION_A_TIMEOUT_S = 3.0
"""How long the client waits for region a before it moves (the SDK's request timeout)."""


async def _count(conn: asyncpg.Connection, session: str = SESSION) -> int:
    return int(await conn.fetchval("SELECT count(*) FROM tandem_turns WHERE session_id = $1", session))


async def _replication(rc: RegionsCluster, n: int, session: str = SESSION) -> dict[str, float]:
    """Seconds from now until the session's ``n``-th turn is in region a's store, then in region b's
    replica (both polled on open connections), and the replica's replay lag as the primary reports it."""
    primary = await asyncpg.connect(rc.server_url("a"), timeout=5)
    replica = await asyncpg.connect(rc.server_url("b"), timeout=5)
    try:
        t0 = time.monotonic()
        while await _count(primary, session) < n:  # one query after another: a row has no notification
            pass
        t1 = time.monotonic()
        while await _count(replica, session) < n:
            pass
        t2 = time.monotonic()
        lag = await primary.fetchval("SELECT extract(epoch FROM replay_lag) FROM pg_stat_replication")
        return {"in_a_s": t1 - t0, "a_to_b_s": t2 - t1, "replay_lag_s": float(lag or 0.0)}
    finally:
        await primary.close()
        await replica.close()


def _cache_turns(rc: RegionsCluster, region: str) -> int | None:
    """Turns of the session in ``region``'s cache; None when the cache does not hold the session."""
    key = f"{cluster_prefix(DEFAULT_CLUSTER)}sess:{ANONYMOUS_TENANT}:{SESSION}"
    with rc.lab.inside("client"), redis.Redis.from_url(rc.region_redis_url(region), socket_timeout=2) as r:
        fields = r.hkeys(key)
    return len([f for f in fields if f != MARKER.encode()]) if MARKER.encode() in fields else None


def _recorded(http: httpx.Client, base: str, n: int) -> list[dict]:
    """The session's turns as ``base``'s router serves them, once it has recorded ``n`` (the router
    records a turn after its answer, off the request's path)."""

    def turns() -> list[dict]:
        r = http.get(f"{base}/v1/sessions/{SESSION}")
        return r.json()["turns"] if r.status_code == 200 else []

    assert wait_for(lambda: len(turns()) >= n, 30, 0.05), f"turn {n} never recorded at {base}"
    return turns()


def _stream(client: openai.OpenAI, model: str, messages: list[Any], **kw: Any) -> tuple[str, int, float]:
    """A streamed chat: (answer, prompt tokens, seconds to the first content token)."""
    t0 = time.monotonic()
    ttft, parts, prompt_tokens = 0.0, [], 0
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.monotonic() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage:
            prompt_tokens = chunk.usage.prompt_tokens
    return "".join(parts), prompt_tokens, ttft


@pytest.fixture(scope="module")
def rc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegionsCluster]:
    with regions_cluster(tmp_path_factory.mktemp("regions")) as cluster:
        yield cluster


@pytest.mark.e2e
def test_a_session_moves_to_region_b_when_region_a_is_lost(rc: RegionsCluster) -> None:
    server = {"x-session-id": SESSION, "x-tandem-history": "server"}
    base = {r: rc.region_router_url(r) for r in ("a", "b")}
    answers: list[str] = []
    ttfts: list[float] = []
    with rc.lab.inside("client"), httpx.Client(timeout=10) as http:
        client = openai.OpenAI(base_url=f"{base['a']}/v1", api_key="none", max_retries=0, timeout=60)
        for i in range(LOST_AFTER):
            answer, _, ttft = _stream(client, rc.model, [{"role": "user", "content": TURNS[i]}], extra_headers=server)
            answers.append(answer)
            ttfts.append(ttft)
            replication = asyncio.run(_replication(rc, i + 1)) if i + 1 == LOST_AFTER else {}
            _recorded(http, base["a"], i + 1)
        assert rc.query("a", "SELECT count(*) FROM tandem_turns")[0][0] == LOST_AFTER
        assert rc.query("b", "SELECT count(*) FROM tandem_turns")[0][0] == LOST_AFTER
        assert _cache_turns(rc, "a") == LOST_AFTER
        assert _cache_turns(rc, "b") is None  # region b never served the session: nothing cached there

    # From the machine's own namespace: the links to cut are there.
    rc.lose_region_a()
    t_lost = time.monotonic()
    rc.promote()
    promoted_s = time.monotonic() - t_lost
    with rc.lab.inside("client"), httpx.Client(timeout=10) as http:
        new: list[Any] = [{"role": "user", "content": TURNS[LOST_AFTER]}]
        with pytest.raises((openai.APIConnectionError, openai.APITimeoutError)):
            client.with_options(timeout=REGION_A_TIMEOUT_S).chat.completions.create(
                model=rc.model,
                messages=new,
                max_tokens=MAX_TOKENS,
                extra_headers=server,
            )
        client = client.with_options(base_url=f"{base['b']}/v1")  # the retry, with the other region's URL
        answer, prompt_tokens, ttft = _stream(client, rc.model, new, extra_headers=server)
        answered_s = time.monotonic() - t_lost
        answers.append(answer)
        turns = _recorded(http, base["b"], LOST_AFTER + 1)
        assert _cache_turns(rc, "b") == LOST_AFTER + 1  # refilled from the store, then the new turn

        # The engine's prompt was the whole conversation: a stateless request carrying it in full has
        # the same prompt and greedy answer; the new message alone has neither.
        full = [m for t in turns[:LOST_AFTER] for m in (*t["messages"], t["response"])] + new
        assert [m["content"] for m in full[0::2]] == TURNS[: LOST_AFTER + 1]
        assert [m["content"] for m in full[1::2]] == answers[:LOST_AFTER]
        control, control_tokens, _ = _stream(client, rc.model, full)
        alone, alone_tokens, _ = _stream(client, rc.model, new)
        assert (answer, prompt_tokens) == (control, control_tokens), (answer, control)
        assert alone_tokens < prompt_tokens
        # The stored turn 4 holds only its new message: the router knew the rest from the store.
        assert turns[LOST_AFTER]["messages"] == new

        last = [{"role": "user", "content": TURNS[-1]}]
        answer, _, last_ttft = _stream(client, rc.model, last, extra_headers=server)
        answers.append(answer)
        turns = _recorded(http, base["b"], len(TURNS))

    assert [t["messages"][0]["content"] for t in turns] == TURNS
    assert [t["response"]["content"] for t in turns] == answers
    assert len({t["turn_id"] for t in turns}) == len(TURNS)
    assert rc.query("b", "SELECT count(*) FROM tandem_turns WHERE session_id = $1", SESSION)[0][0] == len(TURNS)
    assert _cache_turns(rc, "b") == len(TURNS)
    figures = {
        **replication,
        "ttft_turn3_a_s": ttfts[-1],
        "promote_s": promoted_s,
        "failover_ttft_s": ttft,
        "lost_to_answered_s": answered_s,
        "ttft_turn5_b_s": last_ttft,
    }
    print("REGIONS", " ".join(f"{k}={v:.4f}" for k, v in figures.items()))


def _turn(n: int, session: str = "sess-store-failover") -> Turn:
    return Turn(
        turn_id=f"t{n}",
        session_id=session,
        tenant_id=ANONYMOUS_TENANT,
        created_at=float(n),
        messages=[Message(role="user", content=f"turn {n}")],
        response=Message(role="assistant", content=f"answer {n}"),
    )


async def _store(rc: RegionsCluster, region: str) -> SessionStore:
    db = await open_database(rc.region_dsn(region), connect_timeout_s=FAILOVER_S)
    cache = RegionCache(region, redis.asyncio.Redis.from_url(rc.region_redis_url(region), socket_timeout=2))
    store = SessionStore(db, cache, write_attempts=5, retry_backoff_s=0.2)
    await store.init_schema()
    return store


async def _write(store: SessionStore, *turns: Turn) -> None:
    for turn in turns:
        store.record_turn(turn)
    await store.flush()


def test_the_session_store_of_region_b_fails_over_to_its_promoted_replica(tmp_path: Path) -> None:
    """Region b's router and a session store beside it read region a's turns through the primary, then,
    region a lost and the replica promoted, through their own region's server: each first read finds its
    pooled connection dead within the connect timeout and is retried on a fresh one; writes land in
    region b's store. No engine: the turns are written by a session store in region a's router host."""
    session, unread = _turn(0).session_id, "sess-unread"
    with regions_cluster(tmp_path, engines=False) as rc:
        rc.start_routers()
        sessions_b = f"{rc.region_router_url('b')}/v1/sessions"
        loop = asyncio.new_event_loop()
        try:
            with rc.lab.inside("router-a"):
                a = loop.run_until_complete(_store(rc, "a"))
                loop.run_until_complete(_write(a, *(_turn(n) for n in range(3)), _turn(0, unread), _turn(1, unread)))
                loop.run_until_complete(_write(a, _turn(2, unread)))
                replication = loop.run_until_complete(_replication(rc, 3, unread))  # from its commit in a
            with rc.lab.inside("router-b"):
                b = loop.run_until_complete(_store(rc, "b"))
                before = loop.run_until_complete(b.read_store(ANONYMOUS_TENANT, session))
            with rc.lab.inside("client"), httpx.Client(timeout=30) as http:
                assert len(http.get(f"{sessions_b}/{session}").json()["turns"]) == 3  # from the primary
            rc.lose_region_a()
            rc.promote()
            with rc.lab.inside("client"), httpx.Client(timeout=30) as http:
                t0 = time.monotonic()
                served = http.get(f"{sessions_b}/{unread}")  # not in region b's cache: read from the store
                router_read_s = time.monotonic() - t0
            with rc.lab.inside("router-b"):
                t0 = time.monotonic()
                history = loop.run_until_complete(b.read_store(ANONYMOUS_TENANT, session))  # the store, not a cache
                read_s = time.monotonic() - t0
                loop.run_until_complete(_write(b, _turn(3)))
                after = loop.run_until_complete(b.read_store(ANONYMOUS_TENANT, session))
                loop.run_until_complete(b.close())
            loop.run_until_complete(a.close())  # its writer, idle: nothing of region a is reached
        finally:
            loop.close()
        assert served.status_code == 200 and [t["turn_id"] for t in served.json()["turns"]] == ["t0", "t1", "t2"]
        assert router_read_s < FAILOVER_S + 3.0, router_read_s  # neither the 5 s statement timeout nor a 503
        assert [t.turn_id for t in before] == ["t0", "t1", "t2"]  # read across the link, from the primary
        assert [t.turn_id for t in history] == ["t0", "t1", "t2"]
        assert read_s < FAILOVER_S + 3.0, read_s
        assert [t.turn_id for t in after] == ["t0", "t1", "t2", "t3"]
        assert b.stats.failed == 0 and b.stats.written == 1
        assert rc.query("b", "SELECT pg_is_in_recovery()")[0][0] is False
        lag = " ".join(f"{k}={v:.4f}" for k, v in replication.items())
        print(f"REGIONS store failover: {lag} router read {router_read_s:.3f} s, store read {read_s:.3f} s")
