"""``x-tandem-deadline-ms``: a relative budget from arrival, the settings' default without it, 400 when
it is not a positive number of milliseconds up to one hour."""

from __future__ import annotations

import pytest

from contracts.errors import InvalidRequest
from router.admission.deadline import DEADLINE_HEADER, request_deadline


def test_header_budget_counts_from_arrival():
    assert request_deadline("250", 30.0, arrival=100.0) == pytest.approx(100.25)
    assert request_deadline(" 1.5 ", 30.0, arrival=100.0) == pytest.approx(100.0015)
    assert request_deadline("3600000", 30.0, arrival=0.0) == pytest.approx(3600.0)


def test_no_header_uses_the_default():
    assert request_deadline(None, 30.0, arrival=100.0) == 130.0
    assert request_deadline("", 2.0, arrival=100.0) == 102.0


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "soon", "3600001", "1e9"])
def test_bad_values_are_400(bad):
    with pytest.raises(InvalidRequest) as info:
        request_deadline(bad, 30.0, arrival=0.0)
    assert info.value.status_code == 400 and info.value.param == DEADLINE_HEADER
