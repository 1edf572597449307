"""vllm-router (the peer we benchmark against) as a child process in front of our colocated nodes.

Our nodes serve vLLM's own OpenAI API, so vllm-router talks to them as it would to plain ``vllm serve``
workers. ``kv_aware`` is fed by the same KV-event streams our router subscribes to (each node's ZeroMQ
PUB endpoint and its replay endpoint), with the engines' block size; for HTTP workers it gets a prompt's
token ids from the worker's ``POST /v1/chat/completions/render``, which vLLM serves only with
``--enable-scale-out`` (the nodes of the comparison run with it). Its Prometheus counters say whether it
really routed on KV events (``scrape_routing_metrics``). vllm-router 0.1.17 accepts only
``tcp://HOST:PORT`` event endpoints, while a loopback node publishes on ipc (vLLM's publisher binds only
wildcard or ipc endpoints): ``EventRelay`` forwards such a stream, frames unchanged, onto loopback tcp.
Installed with the ``dev`` extra (``pip install vllm-router==0.1.17``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq

from contracts.errors import ConfigError
from contracts.secret import cluster_engine_api_key

VLLM_ROUTER_VERSION = "0.1.17"


def vllm_router_executable() -> str | None:
    """The ``vllm-router`` script of this Python environment, else one on PATH; None if not installed."""
    local = Path(sys.executable).parent / "vllm-router"
    return str(local) if local.exists() else shutil.which("vllm-router")


def require_vllm_router() -> str:
    exe = vllm_router_executable()
    if exe is None:
        raise ConfigError(
            f"vllm-router is not installed: `pip install vllm-router=={VLLM_ROUTER_VERSION}` (or "
            "`make install`, which installs the dev extra), or pass --no-peer to skip the comparison"
        )
    return exe


class EventRelay:
    """An XSUB/XPUB proxy thread: subscribers of ``tcp://127.0.0.1:port`` get the KV events published on
    ``source`` (same frames: topic, sequence number, payload), subscriptions flow upstream."""

    def __init__(self, source: str, port: int) -> None:
        self.source = source
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._ctx = zmq.Context()
        self._control = f"inproc://relay-{port}"
        self._thread: threading.Thread | None = None
        self._steer: zmq.Socket | None = None

    def _run(self, ready: threading.Event) -> None:
        xsub, xpub = self._ctx.socket(zmq.XSUB), self._ctx.socket(zmq.XPUB)
        control = self._ctx.socket(zmq.PAIR)
        try:
            xsub.connect(self.source)
            xpub.bind(self.endpoint)
            control.connect(self._control)
            ready.set()
            zmq.proxy_steerable(xsub, xpub, None, control)
        finally:
            for sock in (xsub, xpub, control):
                sock.close(linger=0)

    def __enter__(self) -> EventRelay:
        self._steer = self._ctx.socket(zmq.PAIR)
        self._steer.bind(self._control)
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"relay {self.source}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise ConfigError(f"KV-event relay {self.source} -> {self.endpoint} did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._steer is not None:
            self._steer.send(b"TERMINATE")
            if self._thread is not None:
                self._thread.join(10)
            self._steer.close(linger=0)
        self._ctx.term()


@dataclass(frozen=True)
class PeerWorker:
    url: str
    kv_events: str
    kv_replay: str


@dataclass
class VllmRouter:
    port: int
    policy: str
    """vllm-router's --policy: cache_aware (approximate tree of request text) or kv_aware (KV events)."""
    workers: list[PeerWorker]
    block_size: int
    model: str
    log: Path
    metrics_port: int | None = None
    """vllm-router's Prometheus port (its default, 29000, is shared by every instance on a host)."""
    startup_timeout_s: float = 120.0
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, exe: str) -> list[str]:
        cmd = [
            exe,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--policy",
            self.policy,
            "--worker-urls",
            *[w.url for w in self.workers],
            "--worker-startup-check-interval",
            "1",
            # Tandem's engines want the cluster's engine key (an open engine ignores it). On the command
            # line: vllm-router has no other way to take it, and this is a loopback benchmark.
            "--api-key",
            cluster_engine_api_key(loopback_only=True),
        ]
        if self.metrics_port is not None:
            cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port)]
        if self.policy == "kv_aware":
            for w in self.workers:
                cmd += [
                    "--kv-event-source",
                    f"{w.url}={w.kv_events}",
                    "--kv-event-replay-source",
                    f"{w.url}={w.kv_replay}",
                ]
            cmd += ["--kv-event-block-size", str(self.block_size), "--kv-event-model", self.model]
        return cmd

    def scrape_routing_metrics(self) -> dict[str, float]:
        """vllm-router's counters of routing decisions and KV-aware lookups (sample line -> value)."""
        if self.metrics_port is None:
            return {}
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        keep = (
            "vllm_router_kv_",
            "vllm_router_prefix_routing",
            "vllm_router_policy_decisions",
            "vllm_router_cache_hits",
            "vllm_router_cache_misses",
            "vllm_router_processed_requests",
        )
        out = {}
        for line in text.splitlines():
            if line.startswith(keep):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def __enter__(self) -> VllmRouter:
        exe = require_vllm_router()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(self.command(exe), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(
                    f"vllm-router --policy {self.policy} exited with status {self.proc.returncode}; see {self.log}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.5)  # polling a child that has no readiness callback
        self.__exit__()
        raise ConfigError(f"vllm-router not ready after {self.startup_timeout_s:.0f} s; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
