"""Several models behind one router (router.model_table through the real request path): routing by the
request's model, an alias, a fallback for a model with no node and for one whose node has no slot, a
90/10 canary over 200 requests, /v1/models, and the metrics labels. The real router app under uvicorn
with the real Redis; the nodes are STAND-IN engines (``bench.standin_engine``) that record what reached
them, so each test counts where requests went."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx

from contracts.registry import Role
from tests.router.admission.support import wait_until
from tests.support.standin_cluster import metric, standin_cluster

CHAT = "/v1/chat/completions"


def _names() -> tuple[str, str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"a-{tag}", f"b-{tag}", f"c-{tag}"


def _models_file(tmp_path: Path, a: str, b: str, c: str) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(
        f"""
[aliases]
"small-{a}" = "{a}"

[fallbacks]
"{c}" = "{a}"
"{b}" = "{a}"

[canaries."coder-{a}"]
"{a}" = 90
"{b}" = 10
"""
    )
    return path


def _chat(model: str, content: str = "hi") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


async def test_routes_by_name_alias_and_fallback_and_lists_models(tmp_path: Path) -> None:
    a, b, c = _names()
    roles = {"na": Role.BOTH, "nb": Role.BOTH}
    models = {"na": a, "nb": b}
    router = {"models": _models_file(tmp_path, a, b, c)}
    async with standin_cluster(tmp_path, roles, models=models, router=router) as cl:
        ea, eb = cl.engines["na"], cl.engines["nb"]
        async with httpx.AsyncClient(base_url=cl.url, timeout=30) as client:
            for model, engine, content in ((a, ea, "to-a"), (b, eb, "to-b")):
                r = await client.post(CHAT, json=_chat(model, content))
                assert r.status_code == 200, r.text
                assert r.json()["model"] == model  # what the engine says
                assert engine.bodies()[-1]["messages"][0]["content"] == content
            # The alias: the engine is asked for the served name, which is what the answer names.
            r = await client.post(CHAT, json=_chat(f"small-{a}", "via-alias"))
            assert r.status_code == 200, r.text
            assert r.json()["model"] == a
            assert [x["model"] for x in ea.bodies()] == [a, a]
            assert [x["messages"][0]["content"] for x in eb.bodies()] == ["to-b"]
            # c has no node at all: its fallback a answers, streamed too.
            r = await client.post(CHAT, json=_chat(c, "to-c"))
            assert r.status_code == 200, r.text
            assert r.json()["model"] == a
            r = await client.post(CHAT, json={**_chat(c, "to-c-stream"), "stream": True})
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
            assert [x["messages"][0]["content"] for x in ea.bodies()][-2:] == ["to-c", "to-c-stream"]
            # Unknown: the usual 404, and the client's string is no metrics label.
            r = await client.post(CHAT, json=_chat("no-such-model-here"))
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text

            listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
            assert set(listed) == {a, b, f"small-{a}", f"coder-{a}"}  # c has no node: not listed
            assert (listed[a]["parent"], listed[f"small-{a}"]["parent"], listed[f"coder-{a}"]["parent"]) == (None, a, a)

            page = (await client.get("/metrics")).text
            assert metric(page, "tandem_model_resolutions_total", requested=f"small-{a}", served=a, via="alias") == 1
            assert metric(page, "tandem_model_resolutions_total", requested=c, served=a, via="fallback") == 2
            assert metric(page, "tandem_model_resolutions_total", requested=b, served=b, via="direct") == 1
            assert metric(page, "tandem_requests_total", model=a, status="ok") == 4
            assert "no-such-model-here" not in page
            assert metric(page, "tandem_requests_total", model="(unknown)", status="rejected") == 1


async def test_canary_splits_200_requests_90_10(tmp_path: Path) -> None:
    a, b, c = _names()
    roles = {"na": Role.BOTH, "nb": Role.BOTH}
    router = {"models": _models_file(tmp_path, a, b, c)}
    async with standin_cluster(tmp_path, roles, models={"na": a, "nb": b}, router=router) as cl:
        async with httpx.AsyncClient(base_url=cl.url, timeout=30) as client:
            answers = []
            for batch in range(10):  # 20 at a time: concurrent, as clients are
                rs = await asyncio.gather(
                    *(client.post(CHAT, json=_chat(f"coder-{a}", f"r{batch}-{i}")) for i in range(20))
                )
                assert [r.status_code for r in rs] == [200] * 20, [r.text for r in rs if r.status_code != 200]
                answers += [r.json()["model"] for r in rs]
            to_a, to_b = len(cl.engines["na"].bodies()), len(cl.engines["nb"].bodies())
            assert to_a + to_b == 200
            assert abs(to_b / 200 - 0.10) <= 0.10  # the acceptance line: within ±10 points
            assert (to_a, to_b) == (180, 20)  # one router, smooth weighted round robin: exact
            assert answers.count(b) == 20  # the answer names the version that produced it
            page = (await client.get("/metrics")).text
            assert metric(page, "tandem_model_resolutions_total", requested=f"coder-{a}", served=b, via="canary") == 20


async def test_a_model_without_a_free_slot_goes_to_its_fallback(tmp_path: Path) -> None:
    a, b, c = _names()
    roles = {"na": Role.BOTH, "nb": Role.BOTH}
    router = {"models": _models_file(tmp_path, a, b, c)}
    async with standin_cluster(
        tmp_path, roles, models={"na": a, "nb": b}, router=router, node_max_concurrency=1, node_max_queue=0
    ) as cl:
        ea, eb = cl.engines["na"], cl.engines["nb"]
        eb.close_gate()
        async with httpx.AsyncClient(base_url=cl.url, timeout=30) as client:
            held = asyncio.create_task(client.post(CHAT, json=_chat(b, "holds-b")))
            await wait_until(lambda: len(eb.received) == 1)
            r = await client.post(CHAT, json=_chat(b, "b-is-full"))
            assert r.status_code == 200, r.text
            assert r.json()["model"] == a
            assert [x["messages"][0]["content"] for x in ea.bodies()] == ["b-is-full"]
            # a has no fallback: once its one slot is taken, its requests are refused (503), not moved.
            ea.close_gate()
            held_a = asyncio.create_task(client.post(CHAT, json=_chat(a, "holds-a")))
            await wait_until(lambda: len(ea.received) == 2)
            r = await client.post(CHAT, json=_chat(a, "a-is-full"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
            eb.open_gate()
            ea.open_gate()
            assert [(await t).status_code for t in (held, held_a)] == [200, 200]
            page = (await client.get("/metrics")).text
            assert metric(page, "tandem_model_resolutions_total", requested=b, served=a, via="fallback") == 1
