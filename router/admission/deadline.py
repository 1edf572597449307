"""Request deadlines: how long a request may wait for its node slots before it is dropped unserved.

A client gives a time budget in milliseconds, counted from the request's arrival at the router, with
``x-tandem-deadline-ms: <ms>``; without it, ``AdmissionSettings.request_deadline_s`` applies. A budget
is relative (not a wall-clock instant) so that client and router clocks need not agree, as gRPC's
``grpc-timeout``. The router turns it into an absolute ``time.monotonic()`` instant once, on arrival.
"""

from __future__ import annotations

import math

from contracts.errors import InvalidRequest

DEADLINE_HEADER = "x-tandem-deadline-ms"
MAX_DEADLINE_MS = 3_600_000
"""One hour: a longer wait is a client bug, not a deadline."""


def request_deadline(header: str | None, default_s: float, *, arrival: float) -> float:
    """The absolute deadline (``time.monotonic()`` seconds) of a request that arrived at ``arrival``.
    Raises ``InvalidRequest`` (400) for a header that is not a number of ms in (0, 3,600,000]."""
    if header is None or header.strip() == "":
        return arrival + default_s
    try:
        ms = float(header)
    except ValueError:
        ms = math.nan
    if not 0 < ms <= MAX_DEADLINE_MS:  # also false for NaN
        raise InvalidRequest(
            f"{DEADLINE_HEADER} must be a number of milliseconds in (0, {MAX_DEADLINE_MS}], not {header!r}",
            param=DEADLINE_HEADER,
        )
    return arrival + ms / 1000.0
