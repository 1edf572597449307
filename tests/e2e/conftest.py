"""One real cluster for the end-to-end tests, started through `tandem up` itself.

1 prefill + 1 decode + 1 colocated (`both`) node, float32 weights (bit-stable greedy output), router,
registry in its own Redis database. Node i listens on NODE_BASE + 10*i in that order.

It lives as long as this folder's tests (package scope, which needs the folder to be a package:
``tests/contracts/test_test_folders.py``), not the whole session: its three float32
engines hold about 11 GiB, and the lab's three (``tests/lab``), started later, hold as much again. Held
to the session's end, the two left a 24 GiB host under 300 MB available while the lab ran (the kernel
compacting on every fault); what CI saw fail after tests/e2e (a lab engine gone after a fault, the
fuzzed router silent for 10 s) fits a host that short of memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from contracts.registry import NODES_SET
from tests.conftest import REDIS_E2E_URL
from tests.support.helpers import OutputLines, stop_group, wait_for  # noqa: F401 - wait_for re-exported for the e2e tests

ROUTER_PORT = 18000
NODE_BASE = 18100
START_TIMEOUT_S = 900


@dataclass(frozen=True)
class LiveCluster:
    url: str
    prefill_url: str
    decode_url: str
    both_url: str
    model: str
    redis_url: str
    lake: Path


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    workdir = tmp_path_factory.mktemp("cluster")
    redis.Redis.from_url(REDIS_E2E_URL).flushdb()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem",
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--both",
            "1",
            "--dtype",
            "float32",
            "--port",
            str(ROUTER_PORT),
            "--node-base-port",
            str(NODE_BASE),
            "--redis-url",
            REDIS_E2E_URL,
            "--workdir",
            str(workdir),
            # One router: tests read its /metrics and /cluster, which two replicas would split between
            # them (tests/router/test_router_replicas.py covers replicas).
            "--routers",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = OutputLines(proc)
    try:
        output.until("READY ", START_TIMEOUT_S, what="tandem up")
        model = httpx.get(f"http://127.0.0.1:{ROUTER_PORT}/v1/models").json()["data"][0]["id"]
        yield LiveCluster(
            url=f"http://127.0.0.1:{ROUTER_PORT}",
            prefill_url=f"http://127.0.0.1:{NODE_BASE}",
            decode_url=f"http://127.0.0.1:{NODE_BASE + 10}",
            both_url=f"http://127.0.0.1:{NODE_BASE + 20}",
            model=model,
            redis_url=REDIS_E2E_URL,
            lake=workdir / "lake",
        )
    finally:
        stop_group(proc, Path(workdir, "logs"))
    # A clean stop deregisters every node at once (no waiting for heartbeats to lapse).
    assert registry_empty(REDIS_E2E_URL), "nodes still registered after tandem up stopped"


def engine_metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of one metric's samples on an engine, filtered by labels."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def prompt_tokens_by_source(base_url: str) -> dict[str, float]:
    """An engine's prompt tokens so far by where they came from: computed, its own cache, loaded KV."""
    return {
        s: engine_metric(base_url, "vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


def registry_empty(redis_url: str) -> bool:
    return redis.Redis.from_url(redis_url).scard(NODES_SET) == 0
