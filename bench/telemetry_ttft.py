"""TTFT with telemetry on vs off, same engines, same run: two routers over one colocated node, one
with the per-request emitter on and one with it off, measured in alternating rounds so drift in the
shared machine hits both alike."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import percentile, run_level
from bench.pd import bench_prompts
from infra.errors import ConfigError
from infra.launcher import Cluster, ClusterSpec


def _start_router(port: int, redis_url: str, telemetry: bool, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TANDEM_ROUTER_TELEMETRY": "true" if telemetry else "false"}
    cmd = [sys.executable, "-m", "infra.cli", "router", "--port", str(port), "--redis-url", redis_url]
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_router(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # polling a child process without a readiness callback
    raise ConfigError(f"router {url} not healthy")


def run_ttft_on_off(redis_url: str, *, concurrency: int = 32, rounds: int = 3, max_tokens: int = 16,
                    router_port: int = 18700, node_base_port: int = 18800) -> dict[str, Any]:
    workdir = Path(".tandem") / "bench-telemetry"
    spec = ClusterSpec(prefill=0, decode=0, both=1, router_port=router_port, node_base_port=node_base_port,
                       redis_url=redis_url, workdir=workdir)
    off_port = router_port + 1
    ttft: dict[str, list[float]] = {"on": [], "off": []}
    with Cluster(spec) as cluster:
        off = _start_router(off_port, cluster.redis_url, False, cluster.logs / "router-telemetry-off.log")
        try:
            off_url = f"http://127.0.0.1:{off_port}"
            _wait_router(off_url)
            model = httpx.get(f"{cluster.url}/v1/models").json()["data"][0]["id"]
            prompts = bench_prompts()
            for _ in range(rounds):
                for mode, url in (("on", cluster.url), ("off", off_url)):
                    _, results = asyncio.run(run_level(url, model, prompts, concurrency, concurrency, max_tokens))
                    ttft[mode] += [r.ttft_s for r in results if r.ok]
        finally:
            os.killpg(off.pid, signal.SIGTERM)
            off.wait(30)
    on_ms, off_ms = percentile(ttft["on"], 0.5) * 1000, percentile(ttft["off"], 0.5) * 1000
    return {"concurrency": concurrency, "rounds": rounds, "requests_per_mode": len(ttft["on"]),
            "ttft_on_ms": round(on_ms, 1), "ttft_off_ms": round(off_ms, 1),
            "overhead_pct": round(100 * (on_ms - off_ms) / off_ms, 2)}
