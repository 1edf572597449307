"""Lake queries, the report, and the CLI apps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from html.parser import HTMLParser

import pyarrow as pa
import pytest
from PIL import Image
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
    tables = ("requests", "tool_calls", "feedback", "errors", "kv_events", "host_tier")
    assert table_counts(lake) == {t: 0 for t in tables}
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
    # The console wraps at its width, wherever the lake's path puts the line end.
    assert "no request records" in " ".join(res.output.split())
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


def _served(i: int, **kw: object) -> dict:
    row = {
        "request_id": f"q{i}",
        "model": "m",
        "decode_node": "d0",
        "status": "ok",
        "prompt_tokens": 1000,
        "fleet_cached_tokens": 800,
        "routed_cached_tokens": 600,
        "engine_cached_tokens": 500,
        "ttft_s": 0.1,
    }
    return {**row, **kw}


def _write(make_emitter, make_writer, rows: list[dict]) -> None:
    e = make_emitter(start=False, batch_size=1000)
    for row in rows:
        e.emit("requests", row)
    e.flush()
    make_writer().drain()


def test_a_rejected_request_does_not_move_the_hit_rates(make_emitter, make_writer, lake, tmp_path):
    _write(make_emitter, make_writer, [_served(i) for i in range(5)])
    before = render_report(lake, tmp_path / "before")
    assert before.hit_rates == (0.8, 0.6, 0.5)
    # One 100 MB prompt refused as too long: counted, tokenized, never sent to an engine.
    refused = {"request_id": "huge", "status": "rejected", "http_status": 400, "prompt_tokens": 25_000_000}
    shed = {"request_id": "shed", "status": "rejected", "http_status": 503, "decode_node": "d0", "prompt_tokens": 9}
    _write(make_emitter, make_writer, [refused, shed])
    after = render_report(lake, tmp_path / "after")
    assert after.hit_rates == before.hit_rates and after.requests == 7
    summary = dict(after.summary)
    assert summary["hit rate fleet / routed / engine"] == "80.0% / 60.0% / 50.0%"
    assert summary["reached an engine"] == "5"
    assert (
        summary["never reached an engine (not in hit rates or latencies)"] == "2 (2 rejected), 25000009 prompt tokens"
    )
    assert summary["outcomes (requests.status)"] == "ok 5, rejected 2"
    assert after.tables == before.tables


def test_outcome_counts_agree_and_component_errors_are_labelled_apart(make_emitter, make_writer, lake, tmp_path):
    rows = [_served(0), _served(1, status="error"), _served(2, status="cancelled"), _served(3, status="cancelled")]
    rows.append({"request_id": "r", "status": "rejected", "http_status": 429})
    _write(make_emitter, make_writer, rows)
    summary = dict(render_report(lake, tmp_path / "rep").summary)
    assert summary["outcomes (requests.status)"] == "ok 1, error 1, cancelled 2, rejected 1"
    assert summary["reached an engine"] == "4"  # an error or a cancel after routing did reach one
    assert summary["component error reports (errors table; not request outcomes)"] == "0"
    assert "requests not ok" not in summary and "errors" not in summary


def test_hit_rates_per_tenant_session_and_turn_position(make_emitter, make_writer, lake, tmp_path):
    t0 = time.time() - 100
    rows = []
    for s, tenant in (("sA", "acme"), ("sB", "beta")):
        for turn in range(3):  # turn n: n*400 of 1000 tokens cached by the engine
            rows.append(
                _served(
                    len(rows),
                    session_id=s,
                    tenant_id=tenant,
                    t_arrival=t0 + turn,
                    fleet_cached_tokens=turn * 400,
                    routed_cached_tokens=turn * 400,
                    engine_cached_tokens=turn * 400 if s == "sA" else 0,
                )
            )
    rows.append({"request_id": "x", "session_id": "sA", "status": "rejected", "t_arrival": t0 + 1.5})
    _write(make_emitter, make_writer, rows)
    rep = render_report(lake, tmp_path / "rep")
    assert rep.tables["turn position"] == [("1", 2, 0.0, 0.0, 0.0), ("2", 2, 0.4, 0.4, 0.2), ("3", 2, 0.8, 0.8, 0.4)]
    assert rep.tables["tenant"] == [("acme", 3, 0.4, 0.4, 0.4), ("beta", 3, 0.4, 0.4, 0.0)]
    assert [r[:2] for r in rep.tables["session"]] == [("sA", 3), ("sB", 3)]
    page = rep.index.read_text()
    assert "<h3>By turn position</h3>" in page and "<td>3</td><td>2</td><td>80.0%</td>" in page


def test_reason_chart_counts_codes_not_sentences(make_emitter, make_writer, lake, tmp_path):
    rows = [
        _served(i, routing_reason_code="local_prefill", routing_reason=f"local prefill: {i} uncached tokens <= 256")
        for i in range(4)
    ]
    rows += [_served(9, routing_reason_code="load_guard"), _served(10, routing_reason="from a v1 router")]
    _write(make_emitter, make_writer, rows)
    rep = render_report(lake, tmp_path / "rep")
    assert rep.tables["reason code"] == [
        ("local_prefill", 4, None, None, None),
        ("(no code)", 1, None, None, None),
        ("load_guard", 1, None, None, None),
    ]


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.images: list[str] = []
        self.problems: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        elif tag not in ("meta",):
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack.pop() != tag:
            self.problems.append(f"unbalanced </{tag}>")


def test_report_page_is_well_formed_and_every_image_it_shows_exists(make_emitter, make_writer, lake, tmp_path):
    """The page parses with every tag closed, and every image it shows is a PNG beside it (that a browser
    draws it is checked by the screenshot test below)."""
    _fill(make_emitter, make_writer)
    rep = render_report(lake, tmp_path / "rep")
    page = _Page()
    page.feed(rep.index.read_text())
    assert page.problems == [] and page.stack == []
    assert sorted(page.images) == sorted(p.name for p in rep.images)
    for name in page.images:
        assert (rep.out / name).read_bytes()[:4] == b"\x89PNG"


C0_BLUE = (31, 119, 180)
"""matplotlib's first colour (``C0``, #1f77b4): the report's bars and lines; no other part of the page has it."""
WINDOW = (1280, 4000)


def _screenshot(page: str, png: str, profile: str) -> None:
    """``page`` (a file:// URL) as drawn by headless Chromium, into ``png``."""
    chromium = shutil.which("chromium")
    if chromium is None:
        # `make test` installs it (the Makefile's `browser` step); CI must never skip this check.
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make browser installs it): the report cannot be checked")
        pytest.skip("chromium is not installed (`make browser` installs it)")
    done = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--screenshot={png}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            page,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _c0_pixels(png) -> tuple[tuple[int, int], int]:
    """The screenshot's size, and how many of its pixels are C0 blue (within 3 per channel)."""
    with Image.open(png) as shot:
        rgb = shot.convert("RGB")
        near = sum(
            n
            for n, color in rgb.getcolors(rgb.width * rgb.height) or []
            if max(abs(c - want) for c, want in zip(color, C0_BLUE, strict=True)) <= 3
        )
        return rgb.size, near


def test_report_page_renders_in_a_headless_browser(make_emitter, make_writer, lake, tmp_path):
    """The page as Chromium draws it (a screenshot): the charts' images load and show matplotlib's blue.
    A page whose images are missing or fail to load draws none of it, and fails."""
    _fill(make_emitter, make_writer)
    rep = render_report(lake, tmp_path / "rep")
    shot = tmp_path / "report.png"
    _screenshot(rep.index.resolve().as_uri(), str(shot), str(tmp_path / "profile"))
    size, blue = _c0_pixels(shot)
    assert size == WINDOW
    assert blue >= 20_000, f"{blue} C0-blue pixels: the report's charts did not render"

    # The same page without its images (what a broken page looks like): no blue at all.
    for p in rep.images:
        p.unlink()
    _screenshot(rep.index.resolve().as_uri(), str(tmp_path / "broken.png"), str(tmp_path / "profile"))
    assert _c0_pixels(tmp_path / "broken.png") == (WINDOW, 0)


def test_miss_attribution_is_stacked_by_kind_and_tabled_by_reason(make_emitter, make_writer, lake, tmp_path):
    rows = [
        _served(
            i,
            uncached_tokens=500,
            miss_cold_tokens=100,
            miss_evicted_tokens=50,
            miss_evicted_tier="GPU",
            miss_elsewhere_tokens=300,
            miss_elsewhere_reason="load_guard" if i else "node_down",
            miss_undelivered_tokens=50,
        )
        for i in range(3)
    ]
    rows.append({"request_id": "huge", "status": "rejected", "uncached_tokens": 10**7, "miss_cold_tokens": 10**7})
    _write(make_emitter, make_writer, rows)
    rep = render_report(lake, tmp_path / "rep")
    assert "miss_attribution.png" in [p.name for p in rep.images]
    assert rep.tables["miss kind"] == [
        ("elsewhere (load_guard)", 600, None, None, None),
        ("cold", 300, None, None, None),
        ("elsewhere (node_down)", 300, None, None, None),
        ("evicted (GPU)", 150, None, None, None),
        ("undelivered", 150, None, None, None),
    ]
    assert "<td>elsewhere (load_guard)</td><td>600</td>" in rep.index.read_text()
