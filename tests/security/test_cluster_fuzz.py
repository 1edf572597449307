"""schemathesis against a fresh ``tandem up`` with a real engine (issue 35's acceptance): every check,
every operation of the router's own ``/openapi.json``, first with no key (auth off: the document says
the key is optional, and the server serves without one), then after ``tandem keys create`` (auth on
and failing closed: the document says the key is required, and ``ignored_auth`` probes every
operation without it and with a wrong one); 0 failures both ways. Then a bounded fuzz run of every
generation route (chat, completions, responses, messages) naming the served model, so that bodies
reach the real engine: no server error (a 5xx other than 503/529, which say "capacity") and the
router process's RSS flat within 50 MB over it, measured after a warm-up run.

One cluster for the module, started once: ``tandem up --colocated`` (one ``both`` node, the prepared
model, one router) in a cluster of its own name on the shared Redis (DB 14, its keys under its own
prefix, deleted after), its SQLite key store in its own workdir, so it starts with no key at all. The
tests run in file order: the first needs a cluster no key was ever created for, and auth once on
stays on (``router.admission.keys``).

The machinery (loading the document with every check on, running each operation's stateless tests,
naming the served model) is ``tests/security/test_api_fuzz.py``'s, which runs the same against a
router in a thread over a stand-in engine. Examples are bounded (``BOUNDS``) and every output budget
is cut to ``CAP`` tokens so the CPU engine answers each in about a second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
import pytest
import schemathesis
from hypothesis import settings

from contracts.cluster import prefix as cluster_prefix
from node_agent.model import default_model_dir
from tests.router.admission.support import delete_prefix
from tests.security.support import REDIS_URL, rss_bytes
from tests.security.test_api_fuzz import GENERATION, SETTINGS, fuzz, load, naming_the_served_model
from tests.support.helpers import OutputLines, stop_group

pytestmark = pytest.mark.e2e

ROUTER_PORT = 18700
NODE_BASE = 18800
START_TIMEOUT_S = 900
CAP = 8
"""Output tokens at most per generated request."""
BOUNDS = settings(SETTINGS, max_examples=10)
"""Per operation and phase: 10 generated examples (plus the explicit and coverage ones)."""
AUTH_ON_SERVED = settings(BOUNDS, max_examples=4)
"""With auth on, the generation routes naming the served model: what that pass adds over the same pass
with auth off (run just before, at ``BOUNDS``) is the key on every call, which 4 examples per route
check as well as 10; each costs an engine answer (about a second here), the suite's slowest part."""
MB = 1024 * 1024
VOCAB = json.loads((default_model_dir() / "config.json").read_text())["vocab_size"]
"""The served model's vocabulary: token ids past it are refused by the engine, a bound per model."""


@dataclass(frozen=True)
class Up:
    url: str
    model: str
    env: dict[str, str]
    """The environment ``tandem keys`` needs to reach this cluster's key store (its Redis and SQLite)."""
    router_pid: int


def _router_pid(launcher: int, port: int) -> int:
    """The router process ``tandem up`` started (``tandem router --port PORT``) among its descendants."""
    for child in psutil.Process(launcher).children(recursive=True):
        cmd = child.cmdline()
        if "router" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port):
            return child.pid
    raise RuntimeError(f"no router on port {port} under pid {launcher}")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    workdir = tmp_path_factory.mktemp("up")
    name = f"secfuzz-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TANDEM_CLUSTER": name,
        "TANDEM_REDIS_URL": REDIS_URL,
        "TANDEM_SQLITE_PATH": str(workdir / "tandem.db"),  # where `tandem up` puts it; said for `tandem keys`
    }
    env.pop("TANDEM_DATABASE_URL", None)  # the cluster's own SQLite store: fresh, no key in it
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem",
            "up",
            "--colocated",
            "--routers",
            "1",
            "--port",
            str(ROUTER_PORT),
            "--node-base-port",
            str(NODE_BASE),
            "--redis-url",
            REDIS_URL,
            "--workdir",
            str(workdir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    output = OutputLines(proc)
    url = f"http://127.0.0.1:{ROUTER_PORT}"
    try:
        output.until("READY ", START_TIMEOUT_S, what="tandem up")
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        yield Up(url=url, model=model, env=env, router_pid=_router_pid(proc.pid, ROUTER_PORT))
    finally:
        stop_group(proc, workdir / "logs")
        import asyncio

        asyncio.run(delete_prefix(REDIS_URL, cluster_prefix(name)))


@pytest.fixture(scope="module")
def admin_key(up: Up) -> str:
    """An admin key made the way the README says (``tandem keys create``): auth turns on."""
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "keys", "create", "--tenant", "fuzz", "--admin"],
        env=up.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


@contextmanager
def statuses() -> Iterator[Counter[tuple[str, int]]]:
    """Every answer schemathesis gets meanwhile, by (path, status)."""
    seen: Counter[tuple[str, int]] = Counter()

    def after_call(context: Any, case: schemathesis.Case, response: Any) -> None:
        seen[(case.operation.path, response.status_code)] += 1

    schemathesis.hook(after_call)  # global only, as in test_api_fuzz: unregistered right after
    try:
        yield seen
    finally:
        schemathesis.hooks.unregister(after_call)


def conforms(up: Up, token: str | None, served: settings = BOUNDS) -> Counter[tuple[str, int]]:
    """Every operation with generated models (404 before any work), then the generation routes with
    the served model (real answers, ``served`` bounding them); 0 failures of any check. The answers,
    by path and status."""
    schema = load(up.url, token)
    with statuses() as seen:
        failures = fuzz(schema, bounds=BOUNDS)
        with naming_the_served_model(up.model, cap=CAP, budgeted=True, vocab=VOCAB):
            failures += fuzz(schema, only=GENERATION, bounds=served)
    assert not failures, "\n\n".join(failures)
    return seen


def test_without_keys_every_check_passes(up: Up) -> None:
    # Fresh: no key yet, so the API and its document are open.
    assert httpx.get(up.url + "/v1/models", timeout=30).status_code == 200
    doc = httpx.get(up.url + "/openapi.json", timeout=30).json()
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}, {}]
    seen = conforms(up, None)
    served = {path for (path, status) in seen if path in GENERATION and status == 200}
    assert served == set(GENERATION), seen  # the engine answered on every generation route


def test_with_a_key_auth_is_on_and_every_check_passes(up: Up, admin_key: str) -> None:
    # Auth on, failing closed: no key, or a wrong one, is a 401 everywhere but /health (the document too).
    for path in ("/v1/models", "/openapi.json", "/docs"):
        assert httpx.get(up.url + path, timeout=30).status_code == 401, path
    wrong = {"Authorization": "Bearer tdm-" + "0" * 40}
    assert httpx.get(up.url + "/v1/models", headers=wrong, timeout=30).status_code == 401
    body = {"model": up.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(up.url + "/v1/chat/completions", json=body, timeout=60).status_code == 401
    mine = {"Authorization": f"Bearer {admin_key}"}
    doc = httpx.get(up.url + "/openapi.json", headers=mine, timeout=30).json()
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}]
    seen = conforms(up, admin_key, served=AUTH_ON_SERVED)
    assert any(path in GENERATION and status == 200 for (path, status) in seen), seen


def test_generation_fuzz_gives_no_server_error_and_router_rss_stays_flat(up: Up, admin_key: str) -> None:
    """A short warm-up run (allocators, tokenizer caches, pools reach their working size; the two tests
    before ran the same routes too), then the measured run: fresh hypothesis examples on every
    generation route, streamed and not."""
    schema = load(up.url, admin_key)

    def run(bounds: settings) -> Counter[tuple[str, int]]:
        # Conformance is the tests above; here what counts is every answer's status (the reports of
        # the failures, if any, say which request had a 5xx).
        with statuses() as seen, naming_the_served_model(up.model, cap=CAP, budgeted=True, vocab=VOCAB):
            failures = fuzz(schema, only=GENERATION, bounds=bounds)
        errors = {k: n for k, n in seen.items() if k[1] >= 500 and k[1] not in (503, 529)}
        assert not errors, (errors, "\n\n".join(failures))
        return seen

    run(settings(BOUNDS, max_examples=3))
    before = rss_bytes(up.router_pid)
    started = time.monotonic()
    seen = run(BOUNDS)
    grown = rss_bytes(up.router_pid) - before
    print(
        f"generation fuzz: {sum(seen.values())} requests in {time.monotonic() - started:.0f} s, "
        f"router RSS {before / MB:.0f} MB -> {(before + grown) / MB:.0f} MB; {dict(seen)}"
    )
    assert sum(n for (_, status), n in seen.items() if status == 200) > 0, seen
    assert grown < 50 * MB, f"router RSS grew {grown / MB:.1f} MB over the fuzz run"
