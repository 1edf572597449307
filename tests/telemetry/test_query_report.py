"""Lake queries, the report, and the CLI apps."""

from __future__ import annotations

import json
import time

import pyarrow as pa
from typer.testing import CliRunner

from telemetry.cli import lake_app, telemetry_app
from telemetry.query import query, table_counts
from telemetry.report import SECTIONS, render_report
from tests.telemetry.conftest import REDIS_URL

runner = CliRunner()


def _fill(make_emitter, make_writer, n: int = 60) -> None:
    e = make_emitter(start=False, batch_size=1000)
    now = time.time()
    for i in range(n):
        p = 100 + i * 10
        e.emit(
            "requests",
            {
                "request_id": f"r{i}",
                "session_id": f"s{i % 4}",
                "tenant_id": f"t{i % 2}",
                "model": "m",
                "prompt_tokens": p,
                "fleet_cached_tokens": p // 2,
                "routed_cached_tokens": p // 3,
                "engine_cached_tokens": p // 4,
                "ttft_s": 0.05 + i / 100,
                "itl_mean_s": 0.02,
                "itl_p99_s": 0.06,
                "routing_decision": "pd" if i % 3 else "colocated",
                "prefill_node": f"p{i % 2}",
                "decode_node": "d0",
                "transfer_s": 0.01 * (i % 5),
                "transfer_bytes": p * 23040,
                "status": "ok",
                "event_time": now - (i % 3) * 3600,
            },
        )
    e.flush()
    make_writer().drain()


def test_empty_lake_queries_return_typed_empty_results(lake):
    assert table_counts(lake) == {t: 0 for t in ("requests", "tool_calls", "feedback", "errors", "kv_events")}
    res = query(lake, "SELECT event_id, ttft_s, date, hour FROM requests")
    assert res.num_rows == 0
    assert res.schema.field("ttft_s").type == pa.float64()


def test_query_sees_hive_partitions(make_emitter, make_writer, lake):
    _fill(make_emitter, make_writer)
    rows = query(lake, "SELECT hour, count(*) AS n FROM requests GROUP BY hour").to_pylist()
    assert sum(r["n"] for r in rows) == 60 and len(rows) == 3
    hit = query(lake, "SELECT sum(fleet_cached_tokens) / sum(prompt_tokens) AS h FROM requests")
    assert 0.45 < hit.column("h")[0].as_py() < 0.55


def test_report_renders_plots_on_a_small_lake(make_emitter, make_writer, lake, tmp_path):
    _fill(make_emitter, make_writer)
    rep = render_report(lake, tmp_path / "rep")
    assert not rep.empty and rep.requests == 60
    assert [p.stem for p in rep.images] == list(SECTIONS)
    for p in rep.images:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    page = rep.index.read_text()
    assert all(f"src='{p.name}'" in page for p in rep.images)


def test_report_on_an_empty_lake_says_so(lake, tmp_path):
    res = runner.invoke(lake_app, ["report", "--out", str(tmp_path / "rep"), "--lake", str(lake)])
    assert res.exit_code == 0, res.output
    assert "no request records" in res.output
    assert "no request records" in (tmp_path / "rep" / "index.html").read_text()
    assert not list((tmp_path / "rep").glob("*.png"))


def test_cli_consume_once_and_query(make_emitter, lake, prefix):
    e = make_emitter(start=False)
    for i in range(25):
        e.emit("errors", {"component": "router", "error_type": "Unavailable", "message": f"m{i}"})
    e.flush()
    # In-process: keep pytest itself at normal priority (test_priority covers idle in a real process).
    args = [
        "consume",
        "--once",
        "--redis-url",
        REDIS_URL,
        "--lake",
        str(lake),
        "--stream-prefix",
        prefix,
        "--cpu-priority",
        "normal",
    ]
    res = runner.invoke(telemetry_app, args)
    assert res.exit_code == 0, res.output
    assert "wrote 25 events" in res.output
    res = runner.invoke(
        lake_app, ["query", "SELECT count(*) AS n FROM errors", "--lake", str(lake), "--format", "json"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip()) == {"n": 25}
    res = runner.invoke(lake_app, ["query", "SELECT nope FROM errors", "--lake", str(lake)])
    assert res.exit_code == 1


def test_cli_help_and_schema():
    res = runner.invoke(telemetry_app, ["consume", "--help"])
    assert res.exit_code == 0 and "--consumer" in res.output and "--batch-entries" in res.output
    res = runner.invoke(telemetry_app, ["schema", "requests"])
    assert res.exit_code == 0 and "engine_cached_tokens" in res.output
