"""What the modules on the shared lab cluster both use: a host link's byte counter, and a streamed P/D
answer with a fault fired into it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.lab.cluster import LabCluster

STORY = "Tell a long story about a lighthouse keeper."


def received(lc: LabCluster, host: str) -> int:
    """Bytes ``host`` received on its link: what its bridge-side peer sent (read in the machine's namespace)."""
    return int(Path(f"/sys/class/net/{lc.lab.hosts[host].outer}/statistics/tx_bytes").read_text())


def story(lc: LabCluster, max_tokens: int) -> dict:
    """A streamed request that runs until ``max_tokens`` (EOS ignored): long enough to fault mid-way."""
    return {
        "model": lc.model,
        "messages": [{"role": "user", "content": STORY}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


def stream_through_a_fault(http: httpx.Client, lc: LabCluster, body: dict, fault: Callable[[], object]) -> float:
    """Stream ``body`` disaggregated, call ``fault`` once five events have arrived, and read to the end.
    The stream must have ended with an error event and ``[DONE]``; returns the seconds from the fault to
    the end."""
    data: list[str] = []
    fault_at = 0.0
    with http.stream(
        "POST", f"{lc.router_url}/v1/chat/completions", headers={"x-tandem-route": "disaggregated"}, json=body
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data.append(line.removeprefix("data: "))
            if not fault_at and len(data) >= 5:
                fault()
                fault_at = time.monotonic()
    ended_after = time.monotonic() - fault_at
    assert fault_at, "the stream ended before the fault"
    assert data[-1] == "[DONE]" and "error" in json.loads(data[-2]), data[-3:]
    return ended_after
