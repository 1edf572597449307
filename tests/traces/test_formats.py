"""The trace file, its importers and generator, and ``tandem trace`` on real files: the shared Mooncake
trace, a lake folder written with the telemetry schema, a synthetic trace."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tandem.cli import app
from telemetry.schemas import SCHEMAS
from traces import TraceError, read_trace, trace_stats, write_trace
from traces.lake import from_lake
from traces.mooncake import import_mooncake
from traces.synth import AgenticSpec, synth_agentic

# The shared Mooncake trace (``../shared/data/traces`` of the checkout's parent; another place by env)
MOONCAKE = Path(os.environ.get("TANDEM_TRACE_DIR", "/work/shared/data/traces")) / "mooncake_conversation_trace.jsonl"
runner = CliRunner()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_import_infers_turns_and_round_trips(tmp_path):
    src = _jsonl(
        tmp_path / "m.jsonl",
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 700, "output_length": 3, "hash_ids": [0, 9]},
            # extends the first request's two full blocks: its next turn
            {"timestamp": 2000, "input_length": 1600, "output_length": 7, "hash_ids": [0, 1, 5, 6]},
        ],
    )
    trace = import_mooncake(src)
    out = tmp_path / "t.parquet"
    write_trace(trace, out)
    back = read_trace(out)
    rows = back.table.to_pylist()
    assert [r["arrival_s"] for r in rows] == [0.0, 0.5, 2.0]
    assert [r["parent_request_id"] for r in rows] == [None, None, "r0"]
    assert rows[2]["session_id"] == rows[0]["session_id"] != rows[1]["session_id"]
    assert [r["turn"] for r in rows] == [0, 0, 1]
    assert rows[0]["block_hashes"][:2] == rows[2]["block_hashes"][:2]
    assert back.meta.block_tokens == 512 and back.meta.source == "mooncake:m.jsonl"
    # ceiling at 512: request 1 hits block 0 (512 of 700), request 2 blocks 0-1 (1024 of 1600)
    c = trace_stats(back, 512).ceiling
    assert (c.hit_tokens, c.prompt_tokens, c.hit_blocks, c.base_blocks) == (1536, 3400, 3, 9)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not a Mooncake trace line"),
        ('{"timestamp": 0, "input_length": 600}', "not a Mooncake trace line"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "expected one per 512"),
        ('{"timestamp": "x", "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', "must be numbers"),
    ],
)
def test_mooncake_bad_lines_are_refused_with_their_line_number(tmp_path, line, message):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [3]}\n' + line + "\n")
    with pytest.raises(TraceError, match=f"bad.jsonl:2: .*{message}"):
        import_mooncake(src)


def test_shared_mooncake_trace_ceiling_matches_its_readme(tmp_path):
    result = runner.invoke(app, ["trace", "import", "mooncake", str(MOONCAKE), "--out", str(tmp_path / "mc.parquet")])
    assert result.exit_code == 0, result.output
    assert "12031 requests" in result.output
    result = runner.invoke(app, ["trace", "stats", str(tmp_path / "mc.parquet"), "--block-size", "512", "--json"])
    assert result.exit_code == 0, result.output
    s = json.loads(result.output)
    assert s["requests"] == 12031
    # the README's figure: 105,710 of 288,500 blocks seen before
    assert (s["ceiling"]["hit_blocks"], s["ceiling"]["base_blocks"]) == (105710, 288500)
    assert s["input_tokens"]["mean"] == pytest.approx(12035, abs=1)
    assert 1 < s["sessions"] < 12031


def test_synthetic_agentic_trace_is_seeded_and_shares_prefixes(tmp_path):
    spec = AgenticSpec(sessions=12, seed=3, system_prompts=2, repositories=3)
    a, b = synth_agentic(spec), synth_agentic(spec)
    assert a.table.equals(b.table)
    assert not a.table.equals(synth_agentic(AgenticSpec(sessions=12, seed=4)).table)
    rows = a.table.to_pylist()
    by_id = {r["request_id"]: r for r in rows}
    for r in rows:
        if r["parent_request_id"] is None:
            assert r["turn"] == 0 and r["gap_s"] is None
            continue
        p = by_id[r["parent_request_id"]]
        assert r["session_id"] == p["session_id"] and r["turn"] == p["turn"] + 1 and r["gap_s"] > 0
        # the growing context: the parent's prompt and answer come first
        assert r["input_tokens"] > p["input_tokens"] + p["output_tokens"]
        assert r["block_hashes"][: p["input_tokens"] // 16] == p["block_hashes"][: p["input_tokens"] // 16]
        assert r["arrival_s"] > p["arrival_s"] + r["gap_s"]
    # sessions on the same system prompt share its 1,024 tokens (64 blocks) across sessions
    firsts = [r["block_hashes"][:64] for r in rows if r["turn"] == 0]
    assert len({tuple(f) for f in firsts}) <= 2
    s = trace_stats(a, 16)
    assert s.sessions == 12 and s.ceiling.by_tokens > 0.5


def test_synth_refuses_a_spec_no_session_fits(tmp_path):
    result = runner.invoke(
        app, ["trace", "synth", "agentic", "--out", str(tmp_path / "a.parquet"), "--max-input-tokens", "1000"]
    )
    assert result.exit_code == 1 and "no session fits max_input_tokens=1000" in " ".join(result.output.split())
    assert not (tmp_path / "a.parquet").exists()


def test_cli_synth_then_stats(tmp_path):
    out = tmp_path / "a.parquet"
    result = runner.invoke(app, ["trace", "synth", "agentic", "--out", str(out), "--sessions", "5", "--seed", "1"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["trace", "stats", str(out)])
    assert result.exit_code == 0, result.output
    assert "sessions 5" in result.output and "hit ceiling" in result.output


def _lake_part(lake: Path, rows: list[dict]) -> None:
    schema = SCHEMAS["requests"]
    cols = {f.name: [r.get(f.name) for r in rows] for f in schema}
    part = lake / "requests" / "date=2026-12-01" / "hour=10"
    part.mkdir(parents=True)
    pq.write_table(pa.table(cols, schema=schema), part / "part-0.parquet")


def test_from_lake_rebuilds_sessions_gaps_cancels_and_extending_prompts(tmp_path):
    t0 = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)

    def row(rid, sid, at, dur, prompt, out, cached, status="ok"):
        return {
            "event_id": rid,
            "event_time": t0 + timedelta(seconds=at),
            "request_id": rid,
            "session_id": sid,
            "t_arrival": t0 + timedelta(seconds=at),
            "t_finish": t0 + timedelta(seconds=at + dur),
            "prompt_tokens": prompt,
            "completion_tokens": out,
            "cached_tokens": cached,
            "status": status,
        }

    _lake_part(
        tmp_path,
        [
            row("a0", "A", 0.0, 1.0, 100, 20, 0),
            row("b0", "B", 0.5, 2.0, 64, 10, 0, status="cancelled"),
            row("a1", "A", 3.0, 1.0, 150, 8, 112),  # 100 + 20 + 30 new
            row("n0", None, 4.0, 1.0, 40, 4, 0),
            {**row("x", "A", 5.0, 1.0, 0, 0, 0), "prompt_tokens": None},  # rejected: left out
        ],
    )
    trace = from_lake(tmp_path, block_tokens=16)
    rows = {r["request_id"]: r for r in trace.table.to_pylist()}
    assert list(rows) == ["a0", "b0", "a1", "n0"]
    assert rows["a1"]["parent_request_id"] == "a0" and rows["a1"]["turn"] == 1
    assert rows["a1"]["gap_s"] == pytest.approx(2.0)
    assert rows["a1"]["block_hashes"][:6] == rows["a0"]["block_hashes"][:6]  # 100 tokens: 6 full blocks
    assert rows["b0"]["cancel_after_s"] == pytest.approx(2.0) and rows["a0"]["cancel_after_s"] is None
    assert rows["a1"]["cached_tokens"] == 112 and rows["a1"]["arrival_s"] == pytest.approx(3.0)
    assert rows["n0"]["session_id"] is None and rows["n0"]["parent_request_id"] is None
    assert trace_stats(trace, 16).ceiling.hit_tokens == 96


def test_from_lake_on_an_empty_lake_says_so(tmp_path):
    with pytest.raises(TraceError, match="no requests in the lake"):
        from_lake(tmp_path)


def test_read_trace_refuses_foreign_and_broken_files(tmp_path):
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"a": [1]}), plain)
    with pytest.raises(TraceError, match="not a Tandem trace"):
        read_trace(plain)
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "missing.parquet")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    with pytest.raises(TraceError, match="not a readable Parquet file"):
        read_trace(junk)
    trace = synth_agentic(AgenticSpec(sessions=2))
    newer = tmp_path / "newer.parquet"
    write_trace(trace, newer)
    t = pq.read_table(newer)
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"tandem.trace.schema_version": b"99"}), newer)
    with pytest.raises(TraceError, match="newer than this Tandem's"):
        read_trace(newer)
    result = runner.invoke(app, ["trace", "stats", str(plain)])
    assert result.exit_code == 1 and "not a Tandem trace" in " ".join(result.output.split())
