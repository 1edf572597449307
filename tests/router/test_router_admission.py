"""Admission slots in the router's real request path: per-node queues by class then arrival, batch shed
first (503 + Retry-After), deadlines (dropped, never sent to an engine), the key's class as a ceiling,
P/D slot order, and the queue metrics. The real router app runs under uvicorn with the real Redis;
the nodes are STAND-IN engines (``bench.standin_engine``) whose gate holds requests, so that slots
stay taken as long as a test needs."""

from __future__ import annotations

import asyncio

import httpx

from contracts.registry import Role
from router.admission.priority_class import Priority
from tests.router.admission.support import wait_until
from tests.support.standin_cluster import StandInCluster, metric, standin_cluster

CHAT = "/v1/chat/completions"


def _openai_error(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == code, err
    return err


def _retry_after(resp: httpx.Response) -> int:
    value = int(resp.headers["Retry-After"])
    assert value >= 1
    return value


async def _metric(client: httpx.AsyncClient, name: str, headers: dict[str, str] | None = None, **labels: str) -> float:
    return metric((await client.get("/metrics", headers=headers)).text, name, **labels) or 0.0


def _queued(client: httpx.AsyncClient, c: StandInCluster, node: str, priority: str):  # noqa: ANN202
    async def depth() -> float:
        return await _metric(
            client, "tandem_admission_queue_depth", c.admin_headers, node=c.node_ids[node], priority=priority
        )

    return depth


def _contents(bodies: list[dict]) -> list[str]:
    return [b["messages"][-1]["content"] for b in bodies]


async def test_queued_interactive_is_served_before_earlier_batch(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, node_max_concurrency=1, node_max_queue=8) as c:
        engine = c.engines["n"]
        engine.close_gate()
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            # A streams: its slot must come back when its stream ends, or nothing below is served.
            a = asyncio.create_task(client.post(CHAT, json=c.chat("A", stream=True)))
            await wait_until(lambda: len(engine.received) == 1)
            b1 = asyncio.create_task(client.post(CHAT, json=c.chat("B1"), headers={"x-tandem-priority": "batch"}))
            await wait_until(lambda: _eq(_queued(client, c, "n", "batch"), 1))
            b2 = asyncio.create_task(client.post(CHAT, json=c.chat("B2"), headers={"x-tandem-priority": "batch"}))
            await wait_until(lambda: _eq(_queued(client, c, "n", "batch"), 2))
            i = asyncio.create_task(client.post(CHAT, json=c.chat("I")))
            await wait_until(lambda: _eq(_queued(client, c, "n", "interactive"), 1))
            node = c.node_ids["n"]
            assert await _metric(client, "tandem_admission_slots_in_use", node=node) == 1
            assert len(engine.received) == 1  # the queued requests have not reached the node
            engine.open_gate()
            resps = await asyncio.gather(a, b1, b2, i)
            assert [r.status_code for r in resps] == [200] * 4, [r.text for r in resps]
            assert resps[0].text.rstrip().endswith("data: [DONE]")
            assert _contents(engine.bodies()) == ["A", "I", "B1", "B2"]
            for prio in ("interactive", "batch"):
                assert await _queued(client, c, "n", prio)() == 0
            assert await _metric(client, "tandem_admission_slots_in_use", node=node) == 0


async def _eq(depth, n: float) -> bool:  # noqa: ANN001
    return await depth() == n


async def test_full_queue_sheds_batch_first_with_503_and_retry_after(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, node_max_concurrency=1, node_max_queue=1) as c:
        engine = c.engines["n"]
        engine.close_gate()
        batch = {"x-tandem-priority": "batch"}
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            a = asyncio.create_task(client.post(CHAT, json=c.chat("A")))
            await wait_until(lambda: len(engine.received) == 1)
            b = asyncio.create_task(client.post(CHAT, json=c.chat("B"), headers=batch))
            await wait_until(lambda: _eq(_queued(client, c, "n", "batch"), 1))
            # The queue is full: an interactive arrival evicts the queued batch request...
            i = asyncio.create_task(client.post(CHAT, json=c.chat("I")))
            rb = await b
            _openai_error(rb, 503, "shed")
            _retry_after(rb)
            await wait_until(lambda: _eq(_queued(client, c, "n", "interactive"), 1))
            # ...a batch arrival is refused, and so is an interactive one once no batch is left to evict.
            for name, headers in (("D", batch), ("E", {})):
                r = await client.post(CHAT, json=c.chat(name), headers=headers)
                _openai_error(r, 503, "overloaded")
                _retry_after(r)
            engine.open_gate()
            assert [r.status_code for r in await asyncio.gather(a, i)] == [200, 200]
            assert _contents(engine.bodies()) == ["A", "I"]
            assert await _metric(client, "tandem_admission_shed_total", node=c.node_ids["n"]) == 3


async def test_expired_deadline_is_dropped_and_never_reaches_the_engine(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, node_max_concurrency=1, request_deadline_s=0.3) as c:
        engine = c.engines["n"]
        engine.close_gate()
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            a = asyncio.create_task(client.post(CHAT, json=c.chat("A"), headers={"x-tandem-deadline-ms": "60000"}))
            await wait_until(lambda: len(engine.received) == 1)
            # From the header, then from the settings' default (0.3 s).
            for name, headers in (("late-header", {"x-tandem-deadline-ms": "150"}), ("late-default", {})):
                for stream in (False, True):
                    r = await client.post(CHAT, json=c.chat(name, stream=stream), headers=headers)
                    err = _openai_error(r, 503, "deadline_exceeded")
                    assert err["type"] == "service_unavailable" and "not served" in err["message"]
                    _retry_after(r)
            engine.open_gate()
            assert (await a).status_code == 200
            await asyncio.sleep(0.2)  # nothing dropped may still arrive late at the node
            assert _contents(engine.bodies()) == ["A"]
            assert await _metric(client, "tandem_admission_expired_total", node=c.node_ids["n"]) == 4
            for bad in ("0", "-5", "soon", "3600001"):
                r = await client.post(CHAT, json=c.chat("x"), headers={"x-tandem-deadline-ms": bad})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "x-tandem-deadline-ms"
            assert _contents(engine.bodies()) == ["A"]


async def test_a_header_lowers_the_keys_class_but_never_raises_it(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, node_max_concurrency=1) as c:
        inter = {"Authorization": f"Bearer {await c.create_key('acme')}"}
        batch_key = {"Authorization": f"Bearer {await c.create_key('nightly', Priority.BATCH)}"}
        engine = c.engines["n"]
        engine.close_gate()
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            assert (await client.post(CHAT, json=c.chat("no key"))).status_code == 401
            a = asyncio.create_task(client.post(CHAT, json=c.chat("A"), headers=inter))
            await wait_until(lambda: len(engine.received) == 1)
            specs = [
                ("batch key asks interactive", {**batch_key, "x-tandem-priority": "interactive"}, "batch", 1),
                ("interactive key asks batch", {**inter, "x-tandem-priority": "batch"}, "batch", 2),
                ("interactive key", inter, "interactive", 1),
            ]
            tasks = []
            for name, headers, prio, depth in specs:
                tasks.append(asyncio.create_task(client.post(CHAT, json=c.chat(name), headers=headers)))
                await wait_until(lambda prio=prio, depth=depth: _eq(_queued(client, c, "n", prio), depth))
            engine.open_gate()
            assert [r.status_code for r in await asyncio.gather(a, *tasks)] == [200] * 4
            assert _contents(engine.bodies()) == [
                "A",
                "interactive key",
                "batch key asks interactive",
                "interactive key asks batch",
            ]


async def test_client_gone_while_queued_leaves_no_trace_in_the_queue(tmp_path) -> None:
    async with standin_cluster(tmp_path, {"n": Role.BOTH}, node_max_concurrency=1) as c:
        engine = c.engines["n"]
        engine.close_gate()
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            a = asyncio.create_task(client.post(CHAT, json=c.chat("A")))
            await wait_until(lambda: len(engine.received) == 1)
            async with httpx.AsyncClient(base_url=c.url, timeout=30) as impatient:
                gone = asyncio.create_task(impatient.post(CHAT, json=c.chat("gone")))
                await wait_until(lambda: _eq(_queued(client, c, "n", "interactive"), 1))
                gone.cancel()
            await wait_until(lambda: _eq(_queued(client, c, "n", "interactive"), 0))
            engine.open_gate()
            assert (await a).status_code == 200
            assert (await client.post(CHAT, json=c.chat("B"))).status_code == 200
            assert _contents(engine.bodies()) == ["A", "B"]
            assert await _metric(client, "tandem_admission_slots_in_use", node=c.node_ids["n"]) == 0


async def test_pd_takes_the_decode_slot_first_and_the_prefill_slot_only_for_the_prefill_leg(tmp_path) -> None:
    roles = {"p": Role.PREFILL, "d1": Role.DECODE, "d2": Role.DECODE}
    async with standin_cluster(tmp_path, roles, node_max_concurrency=1) as c:
        p, d1, d2 = c.engines["p"], c.engines["d1"], c.engines["d2"]
        d1.close_gate()
        d2.close_gate()
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            a = asyncio.create_task(client.post(CHAT, json=c.chat("A")))
            await wait_until(lambda: len(d1.received) + len(d2.received) == 1)
            held, other = (d1, d2) if d1.received else (d2, d1)
            # A holds its decode slot; its prefill slot is free again, so B prefills and decodes elsewhere.
            b = asyncio.create_task(client.post(CHAT, json=c.chat("B")))
            await wait_until(lambda: len(other.received) == 1)
            assert _contents(p.bodies()) == ["A", "B"]
            assert all(body["kv_transfer_params"]["stand_in"] for body in held.bodies() + other.bodies())
            # Both decode slots are taken: C waits for one, its deadline passes, and no node saw it,
            # not even the prefill node (no KV computed for a decode that never comes).
            r = await client.post(CHAT, json=c.chat("C"), headers={"x-tandem-deadline-ms": "200"})
            _openai_error(r, 503, "deadline_exceeded")
            held.open_gate()
            other.open_gate()
            assert [x.status_code for x in await asyncio.gather(a, b)] == [200, 200]
            assert _contents(p.bodies()) == ["A", "B"]
            assert (await client.post(CHAT, json=c.chat("D"))).status_code == 200
            assert _contents(p.bodies()) == ["A", "B", "D"]
            for name in roles:
                assert await _metric(client, "tandem_admission_slots_in_use", node=c.node_ids[name]) == 0
