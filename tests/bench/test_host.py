"""The host record every benchmark's JSON carries: the CPU model, the interpreter's speed, and what one
wake-up after idle costs (``bench.host``)."""

from __future__ import annotations

import time

from bench.host import cpu_model, host_record, python_loop_10m_s, wakeup_us

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
"""


def test_the_cpu_model_is_the_first_model_name() -> None:
    assert cpu_model(CPUINFO) == "Intel(R) Xeon(R) Processor"
    assert cpu_model("processor\t: 0\n") is None


def test_a_wakeup_counts_cpu_time_not_the_time_asleep() -> None:
    started = time.monotonic()
    cost = wakeup_us(wakeups=3, sleep_s=0.05)
    assert time.monotonic() - started >= 0.15  # it did sleep, three times
    assert 0 < cost < 50_000  # far under the 50 ms asleep: on-CPU time only


def test_the_loop_figure_is_scaled_to_ten_million_steps() -> None:
    small, large = python_loop_10m_s(steps=100_000), python_loop_10m_s(steps=400_000)
    assert 0.005 < small < 60 and 0.005 < large < 60
    assert 0.25 < small / large < 4  # the same rate, whatever the sample's size


def test_a_probe_taken_before_the_run_is_recorded_as_taken() -> None:
    probe = {"cpu_model": "m", "python_loop_10m_s": 1.5, "wakeup_us": 40.0}
    record = host_record((0.5, 0.4, 0.3), probe)
    assert record["loadavg_1m_before"] == 0.5
    assert {k: record[k] for k in probe} == probe
    assert record["cpus"] >= 1
