"""`tandem bench admission` end to end at a tiny size: real Redis (DB 7), a real router process over
the no-op STAND-IN engine; JSON, PNG and the exact RESULT line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import redis

from contracts.registry import NODES_SET

REDIS_URL = "redis://127.0.0.1:6379/7"


def test_bench_admission_writes_json_png_and_the_result_line(tmp_path: Path) -> None:
    out = tmp_path / "bench-admission.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem",
            "bench",
            "admission",
            "--out",
            str(out),
            "-n",
            "200",
            "--concurrency",
            "1",
            "--concurrency",
            "4",
            "--requests",
            "40",
            "--redis-url",
            REDIS_URL,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"RESULT admit_p50_us=([\d.]+) admit_p99_us=([\d.]+) router_rps=([\d.]+)", last)
    assert m, last
    doc = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    fast, router = doc["admission_fast_path"], doc["router"]
    assert fast["n"] == 200 and 0 < fast["admit_p50_us"] <= fast["admit_p99_us"] <= fast["admit_max_us"]
    assert "STAND-IN" in router["what"] and "stand-in" in router["engine"]
    assert [lv["concurrency"] for lv in router["levels"]] == [1, 4]
    assert all(lv["errors"] == 0 and lv["requests"] == 40 and lv["rps"] > 0 for lv in router["levels"])
    assert doc["result"] == {"admit_p50_us": float(m[1]), "admit_p99_us": float(m[2]), "router_rps": float(m[3])}
    # Nothing of the run is left behind: its node left the registry, its keys are gone.
    r = redis.Redis.from_url(REDIS_URL)
    try:
        assert not [n for n in r.smembers(NODES_SET) if n.startswith(b"standin-")]
        assert not list(r.scan_iter(match="bench-*", count=1000))
    finally:
        r.close()
