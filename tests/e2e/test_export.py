"""Served sessions to a training set, end to end: sessions with tool calls and feedback from two tenants
through a router over `tandem up`'s engines (sessions in PostgreSQL, request and feedback rows in the
cluster's lake through its lake writer), then `tandem lake export` as a subprocess, to local disk and to
an S3-API server.

The S3-API server is moto's server mode (``moto.server.ThreadedMotoServer``, from PyPI): a real HTTP
server on a local port speaking the S3 protocol, reached through s3fs like any endpoint. It is the only
S3-API server we found that runs here without a container runtime.

The router is in-process (``create_app`` in a ``TestClient``, as the key tests of
test_sessions_and_tools.py do), with its own key namespace and a PostgreSQL schema of its own: keys for
two tenants turn auth on there, not on the cluster's shared router.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import jsonschema
import msgspec
import pytest
from fastapi.testclient import TestClient

from router.admission.context import AdmissionContext, AdmissionSettings
from router.edge.app import create_app
from router.sessions.models import Turn
from router.settings import RouterSettings
from telemetry import query
from tests.e2e.conftest import LiveCluster, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PG = "postgresql://postgres@127.0.0.1:5432"
PG_DB = "tandem_test"
MOTO_PORT = 27001
HOOK = "tests.telemetry.export.hooks:mask_secrets"
SECRET = "SECRET-e2e42"
TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}

_TEXT = {"type": "string"}
_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "additionalProperties": False,
    "properties": {
        "id": _TEXT,
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "properties": {"name": _TEXT, "arguments": _TEXT},
        },
    },
}
OPENAI_CHAT_FINETUNE = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "One line of OpenAI's chat fine-tuning JSONL (supervised, with tool calls and weights)",
    "type": "object",
    "required": ["messages"],
    "additionalProperties": False,
    "properties": {
        "messages": {
            "type": "array",
            "minItems": 2,
            "items": {
                "oneOf": [
                    {
                        "type": "object",
                        "required": ["role", "content"],
                        "additionalProperties": False,
                        "properties": {"role": {"enum": ["system", "developer", "user"]}, "content": {}, "name": _TEXT},
                    },
                    {
                        "type": "object",
                        "required": ["role"],
                        "additionalProperties": False,
                        "anyOf": [{"required": ["content"]}, {"required": ["tool_calls"]}],
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": ["string", "null"]},
                            "name": _TEXT,
                            "tool_calls": {"type": "array", "minItems": 1, "items": _CALL},
                            "weight": {"enum": [0, 1]},
                        },
                    },
                    {
                        "type": "object",
                        "required": ["role", "tool_call_id", "content"],
                        "additionalProperties": False,
                        "properties": {"role": {"const": "tool"}, "tool_call_id": _TEXT, "content": _TEXT},
                    },
                ]
            },
        },
        "tools": {"type": "array"},
        "parallel_tool_calls": {"type": "boolean"},
        "metadata": {"type": "object"},
    },
}
"""OpenAI's documented chat fine-tuning line (system/user/assistant/tool messages, assistant ``tool_calls``
and ``weight``), closed to unknown keys; ``metadata`` is ours, carried beside ``messages``."""


async def _pg_schema(schema: str, drop: bool) -> None:
    if not drop:
        admin = await asyncpg.connect(f"{PG}/test")
        try:
            if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", PG_DB):
                await admin.execute(f"CREATE DATABASE {PG_DB}")
        finally:
            await admin.close()
        return
    conn = await asyncpg.connect(f"{PG}/{PG_DB}")
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def _stored_turns(url: str) -> list[Turn]:
    schema = url.rsplit("schema=", 1)[1]
    conn = await asyncpg.connect(f"{PG}/{PG_DB}", server_settings={"search_path": schema})
    try:
        rows = await conn.fetch("SELECT body FROM tandem_turns ORDER BY tenant_id, session_id, created_at, turn_id")
    finally:
        await conn.close()
    return [msgspec.json.decode(r["body"], type=Turn) for r in rows]


@pytest.fixture
def served(cluster: LiveCluster) -> Iterator[tuple[TestClient, dict[str, str], str]]:
    """A router over the cluster's engines with tenants acme and globex; yields (client, keys, db URL)."""
    schema = f"export_{uuid.uuid4().hex[:10]}"
    asyncio.run(_pg_schema(schema, drop=False))
    db_url = f"{PG}/{PG_DB}?schema={schema}"
    adm = AdmissionSettings(redis_url=cluster.redis_url, key_prefix=f"exp{uuid.uuid4().hex[:8]}:", database_url=db_url)

    async def make_keys() -> dict[str, str]:
        ctx = await AdmissionContext.create(adm, start_writer=False)
        try:
            return {t: (await ctx.keys.create_key(t, rpm=1000, tpm=10_000_000))[1] for t in ("acme", "globex")}
        finally:
            await ctx.close()

    keys = asyncio.run(make_keys())
    try:
        with TestClient(create_app(RouterSettings(redis_url=cluster.redis_url, admission=adm))) as client:
            yield client, keys, db_url
    finally:
        asyncio.run(_pg_schema(schema, drop=True))


def _chat(client: TestClient, key: str, session: str, messages: list[dict], **kw: Any) -> dict:
    body = {"model": kw.pop("model"), "messages": messages, "max_tokens": 12, "temperature": 0, **kw}
    resp = client.post(
        "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}", "x-session-id": session}
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def _traffic(client: TestClient, keys: dict[str, str], model: str) -> dict[str, Any]:
    """acme: a tool-call session of three turns (the tool result carries a secret) and a session whose
    one prompt was answered twice and rated both ways; globex (no consent): one session. Feedback on
    three answers."""
    acme, tag = keys["acme"], uuid.uuid4().hex[:6]
    ask = [{"role": "user", "content": "Open README.md and summarise it."}]
    first = _chat(
        client,
        acme,
        f"tool-{tag}",
        ask,
        model=model,
        max_tokens=40,
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "read_file"}},
    )
    calls = first["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "read_file"
    history = [
        *ask,
        {"role": "assistant", "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": f"# Tandem\nkey {SECRET}: P/D serving."},
    ]
    second = _chat(client, acme, f"tool-{tag}", history, model=model, tools=[TOOL])
    history += [second["choices"][0]["message"], {"role": "user", "content": "Thanks. One word?"}]
    history[-2] = {"role": "assistant", "content": history[-2]["content"]}
    third = _chat(client, acme, f"tool-{tag}", history, model=model, tools=[TOOL])
    fruit = [{"role": "user", "content": "Name a fruit."}]
    worse = _chat(client, acme, f"pref-{tag}", fruit, model=model, max_tokens=3)
    better = _chat(client, acme, f"pref-{tag}", fruit, model=model, max_tokens=9)  # answered again: regenerate
    other = _chat(client, keys["globex"], f"priv-{tag}", [{"role": "user", "content": "Private plans."}], model=model)
    for resp, rating in ((worse, -1), (better, 1), (third, 1)):
        fb = client.post(
            "/v1/feedback",
            json={"response_id": resp["id"], "rating": rating},
            headers={"authorization": f"Bearer {acme}"},
        )
        assert fb.status_code == 202, fb.text
    ids = [r["id"] for r in (first, second, third, worse, better, other)]
    sent_third = [*history, third["choices"][0]["message"]]
    return {
        "ids": ids,
        "acme": ids[:5],
        "globex": ids[5],
        "better": better["id"],
        "worse": worse["id"],
        "third": json.loads(json.dumps(sent_third).replace(SECRET, "[redacted]")),
    }


def _export(db_url: str, lake: Path, cwd: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    run_env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TANDEM_DATABASE_URL": db_url,
        "TANDEM_EXPORT_SETTLE_S": "0",
        "TANDEM_EXPORT_REDACT": HOOK,
        **(env or {}),
    }
    argv = [sys.executable, "-m", "tandem", "lake", "export", "--lake", str(lake), "--json", *args]
    proc = subprocess.run(argv, env=run_env, cwd=cwd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"returncode": proc.returncode, "stderr": proc.stderr}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _jsonl(folder: Path) -> list[dict]:
    return [json.loads(x) for p in sorted(folder.glob("*.jsonl")) for x in p.read_text().splitlines()]


def _expected(turns: list[Turn]) -> dict[str, list[dict]]:
    """What each stored turn's example must hold: the session as served up to it, secrets masked."""
    out: dict[str, list[dict]] = {}
    served: dict[str, list[dict]] = {}
    for t in turns:
        own = [msgspec.to_builtins(m) for m in t.messages]
        before = served.get(t.session_id, [])
        context = own if before and own[0] == before[0] else [*before, *own]
        msgs = [*context, msgspec.to_builtins(t.response)]
        served[t.session_id] = msgs
        out[t.turn_id] = json.loads(json.dumps(msgs).replace(SECRET, "[redacted]"))
    return out


def test_export_sessions_tool_calls_and_feedback_exactly_once(
    served: tuple[TestClient, dict[str, str], str], cluster: LiveCluster, tmp_path: Path
) -> None:
    client, keys, db_url = served
    sent = _traffic(client, keys, cluster.model)

    def turns() -> list[Turn]:
        return asyncio.run(_stored_turns(db_url))

    assert wait_for(lambda: len(turns()) == 6, timeout_s=60), [t.turn_id for t in turns()]
    ids_sql = ", ".join(f"'{i}'" for i in sent["ids"])

    def lake_ready() -> bool:
        try:
            reqs = query(cluster.lake, f"SELECT count(*) AS n FROM requests WHERE request_id IN ({ids_sql})")
            fbs = query(cluster.lake, f"SELECT count(*) AS n FROM feedback WHERE response_id IN ({ids_sql})")
        except Exception:  # noqa: BLE001 - a table's first part may be mid-write while we poll
            return False
        return reqs.to_pylist()[0]["n"] == 6 and fbs.to_pylist()[0]["n"] == 3

    assert wait_for(lake_ready, timeout_s=90), "request and feedback rows did not reach the lake"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_DATABASE_URL": db_url}
    consent = [sys.executable, "-m", "tandem", "lake", "consent", "acme", "--allow", "--note", "e2e"]
    assert subprocess.run(consent, env=env, cwd=tmp_path, timeout=120).returncode == 0

    # local disk, chat-jsonl: each of acme's turns once, equal to the stored turns, redacted, schema-valid
    local = tmp_path / "local"
    run = _export(db_url, cluster.lake, tmp_path, "--out", str(local), "--name", "e2e-chat")
    assert run.get("rows") == 5 and run["filtered"] == {"no_consent": 1}, run
    lines = _jsonl(local)
    expected = _expected([t for t in turns() if t.tenant_id == "acme"])
    assert sorted(x["metadata"]["request_id"] for x in lines) == sorted(sent["acme"])
    for line in lines:
        jsonschema.validate(line, OPENAI_CHAT_FINETUNE)
        meta = line["metadata"]
        bare = [{k: v for k, v in m.items() if k != "weight"} for m in line["messages"]]
        assert bare == expected[meta["request_id"]], meta["request_id"]
        assert line["messages"][-1]["weight"] == 1
        assert meta["tenant_id"] == "acme" and meta["status"] == "ok" and meta["ttft_s"] > 0
        assert meta["prompt_tokens"] > 0 and meta["engine_cached_tokens"] is not None
    text = "".join(p.read_text() for p in local.glob("*.jsonl"))
    assert SECRET not in text and "[redacted]" in text and "Private plans" not in text
    third = next(x for x in lines if x["metadata"]["request_id"] == sent["acme"][2])
    answer = third["messages"][-1]
    assert [{k: v for k, v in m.items() if k != "weight"} for m in third["messages"][:-1]] == sent["third"][:-1]
    assert answer.get("content") == sent["third"][-1]["content"]  # what the client was sent, as it was sent
    tool_turn = next(x for x in lines if x["metadata"]["request_id"] == sent["acme"][1])
    assert [m["role"] for m in tool_turn["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert tool_turn["messages"][1]["tool_calls"][0]["function"]["name"] == "read_file"
    rated = {x["metadata"]["request_id"]: x["metadata"]["rating"] for x in lines}
    assert rated[sent["acme"][2]] == 1 and rated[sent["worse"]] == -1
    assert _export(db_url, cluster.lake, tmp_path, "--out", str(local), "--name", "e2e-chat")["rows"] == 0

    # preference pairs: one per rated pair (the fruit prompt answered twice); the lone rating pairs nothing
    pref = tmp_path / "pref"
    run = _export(db_url, cluster.lake, tmp_path, "--format", "preference-jsonl", "--out", str(pref), "--name", "e2e-p")
    assert run.get("rows") == 1, run
    [pair] = _jsonl(pref)
    assert pair["input"]["messages"] == [{"role": "user", "content": "Name a fruit."}]
    assert pair["metadata"]["chosen"]["request_id"] == sent["better"]
    assert pair["metadata"]["rejected"]["request_id"] == sent["worse"]
    assert pair["preferred_output"][0]["role"] == "assistant"

    _s3_parquet_killed_and_resumed(db_url, cluster, tmp_path, sent)


def _s3_parquet_killed_and_resumed(db_url: str, cluster: LiveCluster, tmp_path: Path, sent: dict[str, Any]) -> None:
    import boto3
    import datasets
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=MOTO_PORT, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{MOTO_PORT}"
        creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
        boto3.client("s3", endpoint_url=endpoint, **creds).create_bucket(Bucket="training")
        env = {
            "TANDEM_EXPORT_S3_ENDPOINT_URL": endpoint,
            "TANDEM_EXPORT_S3_ACCESS_KEY_ID": "testing",
            "TANDEM_EXPORT_S3_SECRET_ACCESS_KEY": "testing",
            "TANDEM_EXPORT_S3_REGION": "us-east-1",
            "TANDEM_EXPORT_BATCH_ROWS": "2",
        }
        args = ("--format", "parquet", "--out", "s3://training/tandem", "--name", "e2e-s3")
        killed = _export(
            db_url, cluster.lake, tmp_path, *args, env={**env, "TANDEM_EXPORT_FAULT_KILL_AFTER_PARTS": "2"}
        )
        assert killed.get("returncode") == -9, killed  # SIGKILL after the second part, before its watermark
        fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint)
        assert len(fs.ls("training/tandem")) == 2
        resumed = _export(db_url, cluster.lake, tmp_path, *args, env=env)
        assert resumed.get("rows") == 3, resumed  # the uncommitted part again, then the rest
        assert _export(db_url, cluster.lake, tmp_path, *args, env=env)["rows"] == 0
        local = tmp_path / "from-s3"
        fs.get("training/tandem/", str(local), recursive=True)
        ds = datasets.load_dataset(
            "parquet", data_files=str(local / "*.parquet"), split="train", cache_dir=str(tmp_path / "hf")
        )
        assert sorted(ds["request_id"]) == sorted(sent["acme"])  # each row once
        assert all(m["content"] is None or SECRET not in m["content"] for r in ds for m in r["messages"])
    finally:
        server.stop()
