"""``python -m bench.relay_cpu`` runs a real router over paced stand-in engines and prints its idle CPU
and its CPU per streamed request for each pace (the figures docs/bench/overhead.md quotes); with
``--peer``, vllm-router's over the same stand-ins, and each router's share of CPU in the kernel."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.standin_cluster import REDIS_URL

ROOT = Path(__file__).resolve().parents[2]


def test_it_reports_idle_cpu_and_cpu_per_request_for_each_pace_and_router() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.relay_cpu", "--interval-ms", "1", "5", "--tokens", "4", "--streams", "2"]
        + ["--rounds", "2", "--idle-s", "0.2", "--redis-url", REDIS_URL, "--peer"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"router idle: \d+\.\d\d ms of CPU per second", run.stdout)
    for pace in ("1", "5"):
        found = re.search(
            rf"^{pace} ms per token: router CPU (\d+\.\d\d) ms per request \(rounds [\d., ]+\)$", run.stdout, re.M
        )
        assert found is not None, run.stdout
        assert float(found.group(1)) > 0  # the router did work for its streams
        peer = re.search(
            rf"^{pace} ms per token: vllm-router \({pace} ms\) CPU (\d+\.\d\d) ms per request", run.stdout, re.M
        )
        assert peer is not None and float(peer.group(1)) > 0, run.stdout
        assert re.search(rf"^vllm-router \({pace} ms\) idle: \d+\.\d\d ms", run.stdout, re.M), run.stdout
    shares = re.findall(r"^(.+): (\d+)% of its CPU in the kernel \(user [\d.]+ s, system [\d.]+ s\)$", run.stdout, re.M)
    assert [name for name, _ in shares] == ["router", "vllm-router (1 ms)", "vllm-router (5 ms)"], run.stdout
