"""The kv-transfer bench's summary: the exposed transfer time and the fixed cost per pull come out per
transport, on the best transport in the RESULT line, and a missing figure reads ``na``."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.kv_transfer import PULL_FIXED_TOKENS, KvBenchConfig
from bench.kv_transfer_results import Sample, summarise


def test_summary_reports_exposed_time_and_fixed_cost_on_the_best_transport(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = KvBenchConfig(sizes=(1000, 7500), repeats=2, nixl=False)
    mb = 1e6
    samples = [
        # shm is the fastest at the top size, so its figures are the RESULT's
        Sample("tandem-shm", 7510, 348 * mb, 0.040, 0.060),
        Sample("tandem-shm", 7510, 348 * mb, 0.044, 0.070),
        Sample("tandem-tcp", 7510, 348 * mb, 0.220, 0.250),
        Sample("tandem-tcp", 7510, 348 * mb, 0.230, 0.240),
        Sample("tandem-shm", 1010, 46 * mb, 0.008, None),  # a pull without a report: no exposed time
        Sample("tandem-shm", 1010, 46 * mb, 0.009, 0.020),
    ]
    fixed = [
        Sample("fixed-shm", PULL_FIXED_TOKENS, 2.9 * mb, s)
        for s in (0.0019, 0.0021, 0.0050)  # the median, not the mean
    ] + [Sample("fixed-tcp", PULL_FIXED_TOKENS, 2.9 * mb, 0.006)]
    result = summarise(samples, cfg, {}, 2_900_000, fixed, memcpy_gbps=10.0)
    assert result["best_transport"] == "shm"
    assert result["exposed_whole_ms"] == {"tcp": 245.0, "ipc": None, "shm": 65.0, "ucx": None}
    assert result["transfers"]["tandem-shm"]["1000"]["exposed_ms"] == 20.0
    assert result["pull_fixed_ms"]["shm"] == 2.1 and result["pull_fixed_ms"]["tcp"] == 6.0
    # the spread beside the median: quartiles, and how many pulls they are of
    assert result["pull_fixed_spread_ms"]["shm"] == [2.0, 3.55] and result["pull_fixed_spread_ms"]["tcp"] == [6.0, 6.0]
    assert result["pull_fixed_count"] == {"tcp": 1, "ipc": 0, "shm": 3, "ucx": 0}
    assert result["pull_fixed_spread_ms"]["ipc"] is None
    assert result["targets"]["pull_fixed_at_most_3ms"] is True
    assert result["targets"]["layerwise_at_most_30pct_of_whole"] is None
    # NIXL off: its comparisons are not measured, so neither reads as held
    assert result["targets"]["best_not_slower_than_nixl"] is None
    assert result["targets"]["tcp_not_slower_than_nixl_tcp"] is None
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("RESULT ")
    fields = dict(kv.split("=") for kv in line.removeprefix("RESULT ").split())
    assert fields["exposed_whole_ms"] == "65.000" and fields["pull_fixed_ms"] == "2.100"
    assert fields["exposed_layerwise_ms"] == "na"
    assert fields["pull_fixed_p25_ms"] == "2.000" and fields["pull_fixed_p75_ms"] == "3.550"


def test_plot_draws_layerwise_exposed_time_and_fixed_cost_with_figures_missing(tmp_path: Path) -> None:
    """Layer-wise entries carry no GB/s (only an exposed time), a transport may have no fixed pulls and
    NIXL may not have run: the plot still draws every panel."""
    from bench.kv_transfer_results import plot

    cfg = KvBenchConfig(sizes=(1000,), repeats=1, nixl=False)
    samples = [
        Sample("tandem-shm", 1010, 46e6, 0.009, 0.020),
        Sample("tandem-tcp", 1010, 46e6, 0.040, 0.050),
        Sample("layerwise-shm", 1010, 0.0, 0.0, -0.120),
        Sample("layerwise-tcp", 1010, 0.0, 0.0, None),
    ]
    fixed = [Sample("fixed-shm", PULL_FIXED_TOKENS, 5.9e6, 0.003)]
    result = summarise(samples, cfg, {}, 5_900_000, fixed, memcpy_gbps=8.0)
    out = tmp_path / "kv.png"
    plot(result, out)
    assert out.read_bytes().startswith(b"\x89PNG")


def test_nixl_targets_compare_when_nixl_was_measured(capsys: pytest.CaptureFixture[str]) -> None:
    """With NIXL measured, each comparison is a real True or False, at the largest size."""
    cfg = KvBenchConfig(sizes=(7500,), repeats=1, nixl=True)
    samples = [
        Sample("tandem-shm", 7510, 348e6, 0.040),
        Sample("tandem-tcp", 7510, 348e6, 0.300),
        Sample("nixl", 7510, 348e6, 0.100),  # shm faster than NIXL
        Sample("nixl_tcp", 7510, 348e6, 0.200),  # tcp slower than NIXL over tcp
    ]
    targets = summarise(samples, cfg, {}, 2_900_000, [], memcpy_gbps=10.0)["targets"]
    assert targets["best_not_slower_than_nixl"] is True
    assert targets["tcp_not_slower_than_nixl_tcp"] is False
    capsys.readouterr()
