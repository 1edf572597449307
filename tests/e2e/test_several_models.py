"""Several models behind one router on real engines (issue 16, item 4), through `tandem up --models`:

two colocated nodes, SmolLM2-135M under two served names (``smol`` in float32, ``smol-bf16`` in
bfloat16: no second small model is packaged here, so the second model is the default one under another
name and dtype). The acceptance line, on that cluster:

* both models are listed and routed by name (each answer names the engine's own served model);
* an alias works;
* a 90/10 canary splits 200 requests within ±10 percentage points;
* with one model's node down (its agent stopped: it deregisters at once), its requests, and its canary
  share, go to the fallback.

Redis DB 15; router 18800, nodes 18810 and 18820."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from tests.support.helpers import OutputLines, stop_group, wait_for
from tests.support.standin_cluster import metric

pytestmark = pytest.mark.e2e

REDIS_URL = "redis://127.0.0.1:6379/15"
ROUTER_PORT = 18800
NODE_BASE = 18810
URL = f"http://127.0.0.1:{ROUTER_PORT}"
ROOT = Path(__file__).resolve().parents[2]
MODELS = """
[served.smol]
dtype = "float32"
[served.smol-bf16]
dtype = "bfloat16"

[aliases]
small = "smol"

[fallbacks]
smol-bf16 = "smol"

[canaries.coder]
smol = 90
smol-bf16 = 10
"""


def _ask(client: httpx.Client, model: str, content: str = "Hi") -> str:
    body = {"model": model, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": content}]}
    r = client.post(f"{URL}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["model"]


def _canary(client: httpx.Client, n: int) -> Counter[str]:
    with ThreadPoolExecutor(4) as pool:
        return Counter(pool.map(lambda i: _ask(client, "coder", f"Say {i}"), range(n)))


def _live_nodes() -> int:
    return sum(httpx.get(f"{URL}/health", timeout=5).json()["nodes"].values())


def test_two_models_alias_canary_and_fallback(tmp_path: Path) -> None:
    redis.Redis.from_url(REDIS_URL).flushdb()
    models = tmp_path / "models.toml"
    models.write_text(MODELS)
    up = subprocess.Popen(
        [sys.executable, "-m", "tandem", "up", "--prefill", "0", "--decode", "0", "--both", "1"]
        + ["--models", str(models), "--routers", "1", "--port", str(ROUTER_PORT)]
        + ["--node-base-port", str(NODE_BASE), "--redis-url", REDIS_URL, "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = OutputLines(up)
    try:
        output.until("READY ", 900, what="tandem up")
        with httpx.Client(timeout=120) as client:
            cards = {m["id"]: m for m in client.get(f"{URL}/v1/models").json()["data"]}
            assert set(cards) == {"smol", "smol-bf16", "small", "coder"}, cards
            assert cards["small"]["parent"] == "smol" and cards["smol"]["parent"] is None

            # By name: vLLM answers with its own served name (and refuses any other), so each answer
            # says which engine produced it.
            assert _ask(client, "smol") == "smol"
            assert _ask(client, "smol-bf16") == "smol-bf16"
            assert _ask(client, "small") == "smol"

            split = _canary(client, 200)
            assert sum(split.values()) == 200
            assert abs(split["smol-bf16"] / 200 - 0.10) <= 0.10, split
            assert split["smol-bf16"] > 0, split  # the canary version really served some

            # smol-bf16's node down: SIGTERM to its agent (it deregisters, then `tandem up` restarts it,
            # which takes an engine start: tens of seconds, far more than the requests below).
            agent = next(
                p for p in psutil.Process(up.pid).children() if f"both-1-{NODE_BASE + 10}" in " ".join(p.cmdline())
            )
            assert "smol-bf16" in agent.cmdline()
            agent.send_signal(signal.SIGTERM)
            assert wait_for(lambda: _live_nodes() == 1, timeout_s=30), "the stopped node stayed in the router's view"
            assert _ask(client, "smol-bf16") == "smol"
            assert _canary(client, 20) == {"smol": 20}
            page = client.get(f"{URL}/metrics").text
            got = metric(page, "tandem_model_resolutions_total", requested="smol-bf16", served="smol", via="fallback")
            assert got == 1, page
            assert metric(page, "tandem_model_resolutions_total", requested="small", served="smol", via="alias") == 1
    finally:
        stop_group(up, Path(tmp_path, "logs"))
