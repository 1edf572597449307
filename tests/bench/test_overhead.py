"""bench overhead's arithmetic: per-arm means over rounds, the acceptance targets, and the CPU meter's
window (the figures that decide issue 11 must come out of these exactly)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.overhead import _CpuMeter
from bench.overhead_report import ARMS, plot, summarize, targets


def _round(rps: dict[str, float], cpu: float) -> dict:
    return {
        "arms": {
            a: {
                "vllm_bench": {
                    "req_s": r,
                    "output_tok_s": r * 64,
                    "ttft_p50_ms": 1000 / r,
                    "ttft_p99_ms": 2000,
                    "tpot_p50_ms": 100,
                    "failed": 0,
                    "router_cpu_ms_per_req": cpu if a in ("peer", "tandem") else None,
                },
                "agent": {"req_s": r, "ttft_p50_ms": 500, "failed": 0},
            }
            for a, r in rps.items()
        }
    }


def test_summary_means_over_rounds_and_the_targets() -> None:
    rounds = [
        _round({"plain": 2.0, "peer": 1.9, "node": 1.96, "tandem": 1.92}, 6.0),
        _round({"plain": 2.2, "peer": 2.1, "node": 2.16, "tandem": 2.12}, 7.0),
    ]
    s = summarize(rounds, ARMS)
    assert s["plain"]["req_s"] == 2.1 and s["plain"]["req_s_range"] == [2.0, 2.2]
    assert s["tandem"]["router_cpu_ms_per_req"] == 6.5 and "router_cpu_ms_per_req" not in s["plain"]
    result = {
        "plain_rps": s["plain"]["req_s"],
        "peer_rps": s["peer"]["req_s"],
        "node_rps": s["node"]["req_s"],
        "tandem_rps": s["tandem"]["req_s"],
        "plain_ttft_p50_ms": s["plain"]["ttft_p50_ms"],
        "tandem_ttft_p50_ms": s["tandem"]["ttft_p50_ms"],
        "router_cpu_ms_per_req": 6.5,
        "router_chunks_per_s": 25000,
    }
    assert all(t["met"] for t in targets(result).values())
    slow = {**result, "tandem_rps": 1.9, "router_cpu_ms_per_req": 8.5, "router_chunks_per_s": 19000}
    missed = {k for k, t in targets(slow).items() if not t["met"]}
    assert missed == {
        "tandem_rps >= 0.95 * plain_rps",
        "tandem_rps >= peer_rps",
        "router_cpu_ms_per_req <= 8",
        "router_chunks_per_s >= 20000",
    }


def test_plot_renders(tmp_path: Path) -> None:
    rounds = [_round({"plain": 2.0, "peer": 1.9, "node": 1.96, "tandem": 1.92}, 6.0)]
    doc = {
        "summary": summarize(rounds, ARMS),
        "config": {"num_prompts": 64, "rounds": 1, "input_len": 512, "output_len": 64, "concurrency": 16},
        "host": {"cpus": 2},
        "result": {"router_chunks_per_s": 25000},
    }
    plot(doc, tmp_path / "o.png")
    assert (tmp_path / "o.png").stat().st_size > 10_000


def test_cpu_meter_reads_a_window_of_this_process() -> None:
    meter = _CpuMeter(os.getpid())
    time.sleep(0.3)
    start, cpu0 = time.monotonic(), time.process_time()
    while time.process_time() - cpu0 < 0.4:  # burn 0.4 s of CPU inside the window
        pass
    end = time.monotonic()
    time.sleep(0.3)
    meter.stop()
    used = meter.between(start, end)
    # About the 0.4 s burned in the window (to the meter's 100 ms sampling), not the idle sleeps around it.
    assert 0.25 < used < 0.6, used
