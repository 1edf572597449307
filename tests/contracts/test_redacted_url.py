"""A Redis URL in a log line keeps no password (the Helm chart hands processes URLs with passwords)."""

from __future__ import annotations

import pytest

from contracts.config import redacted


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@tandem-redis:6379/0", "redis://:***@tandem-redis:6379/0"),
        ("redis://user:s3cret@h/2", "redis://user:***@h/2"),
        ("postgresql://tandem:p%40ss@db:5432/tandem", "postgresql://tandem:***@db:5432/tandem"),
        ("redis://:s3cret@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_a_password_never_reaches_the_log(url: str, shown: str) -> None:
    assert redacted(url) == shown
    assert "s3cret" not in redacted(url) and "p%40ss" not in redacted(url)
