"""The host a benchmark ran on, as its JSON results record it: results from different hosts differ by
4-8x per engine step, so every result says where it came from and how busy the host was around it."""

from __future__ import annotations

import os
import platform
from typing import Any


def host_record(load_before: tuple[float, float, float]) -> dict[str, Any]:
    """Cores, host name, and the 1-minute load average before the run (``load_before``) and now."""
    return {
        "cpus": os.cpu_count(),
        "node": platform.node(),
        "loadavg_1m_before": round(load_before[0], 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
