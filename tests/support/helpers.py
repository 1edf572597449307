"""Small helpers shared by tests."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; returns its last value. For state in
    other processes that offers no notification (engine metrics, files, registry keys)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def alive_pids(pids: set[int]) -> list[int]:
    """The processes of ``pids`` still running (zombies, whose parent has not reaped them, count as gone)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


class OutputLines:
    """The stdout of a child started with ``stdout=PIPE, text=True``, read by a thread so a test can
    wait for a line (``READY …``) with a deadline instead of blocking on the pipe."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self.seen: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self._lines.put(line)
        self._lines.put(None)  # end of output: the child closed it, so `until` stops waiting now

    def until(self, prefix: str, timeout_s: float, what: str = "process") -> str:
        """Wait for a line starting with ``prefix`` and return it; RuntimeError (with the output's tail)
        if the child exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{what} not ready in {timeout_s:.0f} s:\n{''.join(self.seen[-40:])}") from None
            if line is None:
                self._lines.put(None)  # a later call sees the end too
                try:  # (a child that closed its output but lingers is not waited for long)
                    code = self.proc.wait(min(30.0, max(0.1, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    code = None
                raise RuntimeError(f"{what} closed its output (exit {code}):\n{''.join(self.seen[-40:])}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited {self.proc.returncode}:\n{''.join(self.seen[-40:])}")


def stop_group(proc: subprocess.Popen, logs: Path, grace_s: float = 90) -> None:  # type: ignore[type-arg]
    """Stop a process group (``tandem up`` and all it started): SIGTERM, SIGKILL past ``grace_s``. Then
    print the tail of each log in ``logs``, which pytest keeps in the CI log when the test failed."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for log in sorted(logs.glob("*.log")):
        print(f"--- {log.name}\n{''.join(log.read_text(errors='replace').splitlines(True)[-15:])}")


def tier_serve_command(model: Path, dtype: str, block_size: int, size_bytes: int) -> list[str]:
    """``tandem tier serve`` for a test's own host tier (its sockets and file come from TANDEM_TIER_*)."""
    import sys

    return [
        sys.executable,
        "-m",
        "tandem",
        "tier",
        "serve",
        "--model",
        str(model),
        "--dtype",
        dtype,
        "--block-size",
        str(block_size),
        "--size",
        str(size_bytes),
    ]


def colocated_node_command(port: int, node_id: str, redis_url: str, log_dir: Path, *extra: str) -> list[str]:
    """``tandem node`` for a test's own colocated float32 node (greedy outputs comparable exactly)."""
    import sys

    return [
        sys.executable,
        "-m",
        "tandem",
        "node",
        "--role",
        "both",
        "--port",
        str(port),
        "--node-id",
        node_id,
        "--redis-url",
        redis_url,
        "--dtype",
        "float32",
        "--log-dir",
        str(log_dir),
        *extra,
    ]


def on_server_loop(server: Any, fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """Run ``fn()`` on the event loop of an app served by ``bench.standin_engine.ServerThread`` (a router
    in the test's process: its index and policies belong to that loop) and return its result."""
    import asyncio

    async def call() -> Any:
        return fn()

    loop = server.server.servers[0].get_loop()
    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout_s)


def in_process_router(redis_url: str, workdir: Path, key_prefix: str, **settings: Any) -> tuple[Any, Any, str]:
    """A real router app served in this process (``bench.standin_engine.ServerThread``) over ``redis_url``'s
    registry, with its admission store in ``workdir`` and its keys under ``key_prefix``; ``settings``
    override ``RouterSettings`` fields. Returns (app, server, url); the caller exits the server."""
    from bench.standin_engine import ServerThread
    from router.admission.context import AdmissionSettings
    from router.edge.app import create_app
    from router.settings import RouterSettings

    admission = AdmissionSettings(
        redis_url=redis_url,
        key_prefix=key_prefix,
        database_url=f"sqlite:///{workdir}/t.db",
        region="local",
        region_cache_urls={},
    )  # type: ignore[call-arg]
    app = create_app(RouterSettings(redis_url=redis_url, registry_refresh_s=1, admission=admission, **settings))
    server = ServerThread(app)
    return app, server, server.__enter__()


def engine_healthy(port: int) -> bool:
    """Whether the engine on loopback ``port`` answers /health."""
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
