"""Shared test settings. Real services only: Redis at 127.0.0.1:6379 (CI and dev machines run it)."""

from __future__ import annotations

import os

import pytest

# Fixtures of the admission and session tests (real Redis, PostgreSQL, SQLite), shared by both folders.
pytest_plugins = ["tests.router.admission.support"]

# Logical Redis databases by suite, so suites never see each other's registry entries.
REDIS_UNIT_URL = os.environ.get("TANDEM_TEST_REDIS_UNIT", "redis://127.0.0.1:6379/2")
REDIS_E2E_URL = os.environ.get("TANDEM_TEST_REDIS_E2E", "redis://127.0.0.1:6379/1")


@pytest.fixture
def redis_unit_url() -> str:
    return REDIS_UNIT_URL
