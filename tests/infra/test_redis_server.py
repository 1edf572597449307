"""The embedded Redis (infra/redis_server.py): starts from a relative workdir, and a graceful restart
(SHUTDOWN SAVE, then a new start on the same workdir) keeps its data, as `tandem bench chaos` needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from infra.redis_server import start_embedded
from tests.node_agent.test_supervisor import free_port_block


def test_a_graceful_restart_from_a_relative_workdir_keeps_the_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    port = free_port_block()
    proc = start_embedded(port, Path(".tandem/redis"))
    try:
        client = redis.Redis(port=port)
        client.set("k", "kept")
        client.shutdown(save=True)  # redis-py swallows the connection the server closes as it exits
        assert proc.wait(10) == 0
        proc = start_embedded(port, Path(".tandem/redis"))
        assert redis.Redis(port=port).get("k") == b"kept"
    finally:
        proc.terminate()
        proc.wait()
