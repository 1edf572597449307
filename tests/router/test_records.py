"""``router.record.records``: the ITL p99 of a request's record is the figure ``statistics.quantiles``
gives (inclusive method), computed without its 98 other cut points."""

from __future__ import annotations

import random
import statistics

import pytest

from router.record.records import p99, request_record
from router.record.trace import RequestTrace


@pytest.mark.parametrize("n", [2, 3, 7, 64, 101, 257])
def test_p99_is_statistics_inclusive_99th_cut_point(n: int) -> None:
    rng = random.Random(n)
    for _ in range(50):
        values = [rng.expovariate(20.0) for _ in range(n)]
        assert p99(values) == statistics.quantiles(values, n=100, method="inclusive")[98]


def test_a_records_itl_fields_come_from_its_token_times() -> None:
    trace = RequestTrace(request_id="chatcmpl-1", kind="chat", model="m")
    trace.arrival, trace.finish = 100.0, 104.0
    trace.token_times = [101.0, 101.05, 101.1, 101.5]  # gaps 0.05, 0.05, 0.4
    record = request_record(trace, endpoint="chat", http_status=200)
    assert record["itl_mean_s"] == pytest.approx(0.5 / 3)
    assert record["itl_p99_s"] == pytest.approx(0.05 * 0.02 + 0.4 * 0.98)  # between the two largest gaps
    single = RequestTrace(request_id="chatcmpl-2", kind="chat", model="m")
    single.token_times = [101.0, 101.2]
    one_gap = request_record(single, endpoint="chat", http_status=200)
    assert one_gap["itl_mean_s"] == pytest.approx(0.2)
    assert one_gap["itl_p99_s"] is None  # one gap has no tail of its own
