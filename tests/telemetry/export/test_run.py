"""The export pipeline over a real session store (SQLite and PostgreSQL) and a lake folder: consent,
exactly once across runs, a run killed after a durable part and resumed, the redaction hook, preference
pairs from the lake's feedback, dry runs, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from contracts.errors import ConfigError
from telemetry.cli import lake_app
from telemetry.export import ExportSettings, ExportSpec, Filters, Format, run_export, set_consent
from telemetry.export import watermark as wmk
from telemetry.export.redact import RedactionError
from tests.telemetry.export.conftest import Store, call, result, user

ROOT = Path(__file__).resolve().parents[3]


def settings(store: Store, **kw) -> ExportSettings:
    return ExportSettings(database_url=store.url, settle_s=0, **kw)


def spec(store: Store, out: Path | None, fmt: Format = Format.CHAT_JSONL, **kw) -> ExportSpec:
    return ExportSpec(
        name=kw.pop("name", "train"), fmt=fmt, out=None if out is None else str(out), lake=store.lake, **kw
    )


def lines(out: Path) -> list[dict]:
    return [json.loads(x) for p in sorted(out.glob("*.jsonl")) for x in p.read_text().splitlines()]


def fill(store: Store) -> None:
    """acme (consenting): a tool-call session of three turns and a plain one; globex: no consent."""
    store.turn("acme", "s1", "r1", 1, [user("Open README.md")], response=call("c1", "README.md"))
    store.turn("acme", "s1", "r2", 2, [result("c1", "# Tandem SECRET-abc")])
    store.turn("acme", "s1", "r3", 3, [user("Thanks")])
    store.turn("acme", "s2", "r4", 4, [user("Hi")])
    store.turn("globex", "s3", "r5", 5, [user("private")])
    set_consent(store.db, "acme", True)
    set_consent(store.db, "initech", False)


def test_consenting_turns_exported_once_then_only_what_is_new(store: Store, tmp_path: Path) -> None:
    fill(store)
    out = tmp_path / "out"
    first = run_export(spec(store, out), settings(store, batch_rows=2))
    assert (first.rows, len(first.parts), first.filtered) == (4, 2, {"no_consent": 1})
    got = lines(out)
    assert [x["metadata"]["request_id"] for x in got] == ["r1", "r2", "r3", "r4"]
    assert {x["metadata"]["tenant_id"] for x in got} == {"acme"}
    assert got[1]["messages"] == [
        {"role": "user", "content": "Open README.md"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "function": {"name": "read_file", "arguments": '{"path": "README.md"}'},
                    "type": "function",
                }
            ],
            "weight": 0,
        },
        {"role": "tool", "content": "# Tandem SECRET-abc", "tool_call_id": "c1"},
        {"role": "assistant", "content": "answer r2", "weight": 1},
    ]

    again = run_export(spec(store, out), settings(store, batch_rows=2))
    assert (again.rows, again.parts) == (0, [])
    store.turn("acme", "s2", "r6", 6, [user("More")])
    store.turn("globex", "s3", "r7", 7, [user("more private")])
    third = run_export(spec(store, out), settings(store, batch_rows=2))
    assert third.rows == 1 and third.parts[0].endswith("train-000002.jsonl")
    assert [x["metadata"]["request_id"] for x in lines(out)] == ["r1", "r2", "r3", "r4", "r6"]
    assert lines(out)[-1]["messages"][:2] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "answer r4", "weight": 0},
    ]
    manifest = wmk.parts(store.db, "train")
    assert [(p.seq, p.rows) for p in manifest] == [(0, 2), (1, 2), (2, 1)]
    assert manifest[-1].last[-1] == "r6"
    listed = json.loads((out / "_train.manifest.json").read_text())
    assert [(p["seq"], p["rows"], Path(p["uri"]).name) for p in listed["parts"]] == [
        (0, 2, "train-000000.jsonl"),
        (1, 2, "train-000001.jsonl"),
        (2, 1, "train-000002.jsonl"),
    ]


def test_killed_run_resumes_without_duplicates(sqlite_store: Store, tmp_path: Path) -> None:
    fill(sqlite_store)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TANDEM_DATABASE_URL": sqlite_store.url,
        "TANDEM_EXPORT_SETTLE_S": "0",
        "TANDEM_EXPORT_BATCH_ROWS": "1",
    }
    argv = [
        sys.executable,
        "-m",
        "tandem",
        "lake",
        "export",
        "--out",
        str(out),
        "--name",
        "k",
        "--lake",
        str(sqlite_store.lake),
    ]
    killed = subprocess.run(argv, env={**env, "TANDEM_EXPORT_FAULT_KILL_AFTER_PARTS": "2"}, cwd=tmp_path, timeout=120)
    assert killed.returncode == -9
    # two parts are on disk, only the first is committed
    assert sorted(p.name for p in out.glob("*.jsonl")) == ["k-000000.jsonl", "k-000001.jsonl"]
    assert [p.seq for p in wmk.parts(sqlite_store.db, "k")] == [0]
    resumed = subprocess.run([*argv, "--json"], env=env, cwd=tmp_path, timeout=120, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["rows"] == 3
    ids = [x["metadata"]["request_id"] for x in lines(out)]
    assert ids == ["r1", "r2", "r3", "r4"]


def test_redaction_hook_masks_and_drops_before_anything_is_written(sqlite_store: Store, tmp_path: Path) -> None:
    fill(sqlite_store)
    sqlite_store.turn("acme", "s9", "r9", 9, [user("DROP-ME please")])
    out = tmp_path / "out"
    res = run_export(
        spec(sqlite_store, out), settings(sqlite_store, redact="tests.telemetry.export.hooks:mask_secrets")
    )
    assert res.rows == 4 and res.filtered["redacted_out"] == 1
    text = "".join(p.read_text() for p in out.glob("*.jsonl"))
    assert "SECRET-abc" not in text and "[redacted]" in text and "DROP-ME" not in text
    assert all(x["metadata"]["redacted"] for x in lines(out))

    broken = settings(sqlite_store, redact="tests.telemetry.export.hooks:broken")
    with pytest.raises(RedactionError):
        run_export(spec(sqlite_store, tmp_path / "o2", name="b"), broken)
    assert not (tmp_path / "o2").exists()
    with pytest.raises(ConfigError):
        run_export(spec(sqlite_store, tmp_path / "o3"), settings(sqlite_store, redact="no.such.module:f"))


def test_preference_pairs_from_feedback_in_the_lake(store: Store, tmp_path: Path) -> None:
    set_consent(store.db, "acme", True)
    store.turn("acme", "s1", "a", 1, [user("Name a fruit")])
    store.turn("acme", "s1", "b", 2, [user("Name a fruit")])  # regenerated: the same context, stored whole
    store.turn("acme", "s2", "c", 3, [user("Name a tool")])
    store.lake_rows("requests", [{"request_id": i, "status": "ok", "ttft_s": 0.1} for i in "abc"])
    store.lake_rows(
        "feedback",
        [
            {"response_id": "a", "request_id": "a", "tenant_id": "acme", "rating": -1},
            {"response_id": "b", "request_id": "b", "tenant_id": "acme", "rating": 1},
            {"response_id": "c", "request_id": "c", "tenant_id": "acme", "rating": 1},
        ],
    )
    out = tmp_path / "pref"
    res = run_export(spec(store, out, Format.PREFERENCE_JSONL), settings(store))
    assert res.rows == 1
    [pair] = lines(out)
    assert pair["input"]["messages"] == [{"role": "user", "content": "Name a fruit"}]
    assert pair["preferred_output"] == [{"role": "assistant", "content": "answer b"}]
    assert pair["non_preferred_output"] == [{"role": "assistant", "content": "answer a"}]
    assert (pair["metadata"]["chosen"]["ttft_s"], pair["metadata"]["rejected"]["rating"]) == (0.1, -1)
    assert run_export(spec(store, out, Format.PREFERENCE_JSONL), settings(store)).rows == 0
    with pytest.raises(ConfigError):  # an export name keeps its format
        run_export(spec(store, out, Format.CHAT_JSONL), settings(store))


def test_failed_turns_only_when_asked_and_marked(sqlite_store: Store, tmp_path: Path) -> None:
    fill(sqlite_store)
    sqlite_store.lake_rows("requests", [{"request_id": "r4", "status": "cancelled"}])
    plain = run_export(spec(sqlite_store, None, dry_run=True), settings(sqlite_store))
    assert plain.rows == 3 and plain.filtered["failed"] == 1
    asked = run_export(spec(sqlite_store, tmp_path / "o", filters=Filters(include_failed=True)), settings(sqlite_store))
    assert asked.rows == 4
    marked = {x["metadata"]["request_id"]: x["metadata"]["failed"] for x in lines(tmp_path / "o")}
    assert marked == {"r1": False, "r2": False, "r3": False, "r4": True}


def test_dry_run_counts_and_writes_nothing(sqlite_store: Store, tmp_path: Path) -> None:
    fill(sqlite_store)
    res = run_export(spec(sqlite_store, tmp_path / "o", dry_run=True), settings(sqlite_store))
    assert (res.rows, res.parts, dict(res.per_tenant)) == (4, [], {"acme": 4})
    assert not (tmp_path / "o").exists() and not sqlite_store.db.has_table("tandem_export_watermarks")


def test_parquet_export_reads_back_with_datasets(sqlite_store: Store, tmp_path: Path) -> None:
    import datasets

    fill(sqlite_store)
    out = tmp_path / "pq"
    assert (
        run_export(spec(sqlite_store, out, Format.PARQUET, name="pq"), settings(sqlite_store, batch_rows=3)).rows == 4
    )
    ds = datasets.load_dataset(
        "parquet", data_files=str(out / "*.parquet"), split="train", cache_dir=str(tmp_path / "hf")
    )
    assert sorted(ds["request_id"]) == ["r1", "r2", "r3", "r4"]
    row = next(r for r in ds if r["request_id"] == "r2")
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert row["messages"][1]["tool_calls"][0]["function"]["name"] == "read_file"


def test_cli_consent_and_export(sqlite_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fill(sqlite_store)
    monkeypatch.setenv("TANDEM_DATABASE_URL", sqlite_store.url)
    monkeypatch.setenv("TANDEM_EXPORT_SETTLE_S", "0")
    runner = CliRunner()
    listed = runner.invoke(lake_app, ["consent"])
    assert listed.exit_code == 0 and "acme\tallowed" in listed.output and "initech\tdenied" in listed.output
    assert runner.invoke(lake_app, ["consent", "globex", "--allow", "--note", "signed"]).exit_code == 0
    res = runner.invoke(lake_app, ["export", "--dry-run", "--json", "--lake", str(sqlite_store.lake)])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert (summary["rows"], summary["per_tenant"]) == (5, {"acme": 4, "globex": 1})
    bad = runner.invoke(lake_app, ["export", "--format", "csv", "--dry-run"])
    assert bad.exit_code == 2
    no_out = runner.invoke(lake_app, ["export"])
    assert no_out.exit_code == 1 and "--out" in no_out.output


def test_report_shows_each_export_its_tenants_coverage_and_filtered(sqlite_store: Store, tmp_path: Path) -> None:
    from telemetry.export.view import export_view
    from telemetry.report import render_report

    fill(sqlite_store)
    sqlite_store.lake_rows("requests", [{"request_id": "r1", "status": "ok", "decode_node": "d0", "prompt_tokens": 9}])
    sqlite_store.lake_rows("feedback", [{"response_id": "r3", "request_id": "r3", "tenant_id": "acme", "rating": 1}])
    run_export(spec(sqlite_store, tmp_path / "o"), settings(sqlite_store))
    view = export_view(settings(sqlite_store))
    [line] = view.exports
    assert (line.name, line.rows, line.per_tenant, line.filtered) == ("train", 4, {"acme": 4}, {"no_consent": 1})
    assert line.feedback_coverage == 0.25
    rep = render_report(sqlite_store.lake, tmp_path / "report", exports=view)
    page = rep.index.read_text()
    assert "<h2>exports</h2>" in page and "acme 4" in page and "no_consent 1" in page and "25.0%" in page
    assert "initech (denied)" in page
    missing = export_view(ExportSettings(database_url=f"sqlite:///{tmp_path}/none.db"))
    assert missing.exports == [] and missing.error


def test_s3_destination_through_moto_server(sqlite_store: Store, tmp_path: Path) -> None:
    """moto's server mode (PyPI): a real S3-API HTTP server on a local port, the only one we found that
    runs here; the export reaches it through s3fs with the endpoint settings, like any S3 endpoint."""
    import boto3
    import s3fs
    from moto.server import ThreadedMotoServer

    fill(sqlite_store)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=27002, verbose=False)
    server.start()
    try:
        endpoint = "http://127.0.0.1:27002"
        boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
        ).create_bucket(Bucket="exports")
        s3 = settings(
            sqlite_store,
            batch_rows=3,
            s3_endpoint_url=endpoint,
            s3_access_key_id="k",
            s3_secret_access_key="s",
            s3_region="us-east-1",
        )
        target = ExportSpec(name="s3", fmt=Format.CHAT_JSONL, out="s3://exports/run", lake=sqlite_store.lake)
        res = run_export(target, s3)
        assert res.rows == 4 and res.parts == ["s3://exports/run/s3-000000.jsonl", "s3://exports/run/s3-000001.jsonl"]
        assert run_export(target, s3).rows == 0
        fs = s3fs.S3FileSystem(key="k", secret="s", endpoint_url=endpoint)
        got = [json.loads(x) for p in res.parts for x in fs.cat_file(p).decode().splitlines()]
        assert [x["metadata"]["request_id"] for x in got] == ["r1", "r2", "r3", "r4"]
        assert json.loads(fs.cat_file("exports/run/_s3.manifest.json"))["parts"][1]["rows"] == 1
    finally:
        server.stop()


def test_bounded_runs_take_the_next_slice_each(store: Store, tmp_path: Path) -> None:
    fill(store)
    out = tmp_path / "o"
    got = [run_export(spec(store, out), settings(store, run_max_turns=2)).rows for _ in range(4)]
    # turns r1..r5 in time order, r5 without consent: slices r1-r2, r3-r4, r5 (filtered), nothing
    assert got == [2, 2, 0, 0]
    assert [x["metadata"]["request_id"] for x in lines(out)] == ["r1", "r2", "r3", "r4"]
    assert lines(out)[2]["messages"][0] == {"role": "user", "content": "Open README.md"}  # context from slice 1
