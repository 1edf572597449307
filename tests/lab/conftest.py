"""A failed lab test's report carries the cluster's logs: the lab's work folder (router, nodes, engines)
is removed with the lab, and a CI log is all anyone has of a fault that happened there."""

from __future__ import annotations

from collections.abc import Generator

import pytest

LOG_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, None, None]:
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for value in getattr(item, "funcargs", {}).values():
        log_tails = getattr(value, "log_tails", None)
        if callable(log_tails):
            report.sections.append(("lab cluster logs", log_tails(LOG_LINES)))
