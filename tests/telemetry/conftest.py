"""Fixtures: the real Redis (logical DB 3, a unique key prefix per test), fresh metrics, a lake folder."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from telemetry.emitter import Emitter, EmitterConfig
from telemetry.lake_writer import LakeWriter, WriterConfig
from telemetry.metrics import TandemMetrics

REDIS_URL = "redis://127.0.0.1:6379/3"


@pytest.fixture
def r() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    yield client
    client.close()


@pytest.fixture
def prefix(r: redis.Redis) -> Iterator[str]:
    p = f"tandem:test:{uuid.uuid4().hex[:12]}"
    yield p
    for key in r.scan_iter(f"{p}:*"):
        r.delete(key)


@pytest.fixture
def metrics() -> TandemMetrics:
    return TandemMetrics(CollectorRegistry())


@pytest.fixture
def lake(tmp_path: Path) -> Path:
    d = tmp_path / "lake"
    d.mkdir()
    return d


@pytest.fixture
def make_emitter(prefix: str, metrics: TandemMetrics) -> Iterator[Callable[..., Emitter]]:
    made: list[Emitter] = []

    def make(**kw: object) -> Emitter:
        start = bool(kw.pop("start", True))
        cfg = EmitterConfig(**{"redis_url": REDIS_URL, "stream_prefix": prefix, "source": "test", **kw})
        e = Emitter(cfg, metrics=metrics, start=start)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close(timeout_s=5)


@pytest.fixture
def make_writer(prefix: str, lake: Path, metrics: TandemMetrics) -> Iterator[Callable[..., LakeWriter]]:
    made: list[LakeWriter] = []

    def make(**kw: object) -> LakeWriter:
        cfg = WriterConfig(**{"lake": lake, "redis_url": REDIS_URL, "stream_prefix": prefix, "consumer": "w0", **kw})
        w = LakeWriter(cfg, metrics=metrics)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def wait_until(pred: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll ``pred`` until true or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def closed_port() -> int:
    """A local TCP port with nothing listening."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def sample(metrics: TandemMetrics, name: str, **labels: str) -> float:
    """Current value of one metric sample (0 when it has never been touched)."""
    return metrics.registry.get_sample_value(name, labels) or 0.0


def dropped(metrics: TandemMetrics, table: str, reason: str) -> float:
    return sample(metrics, "tandem_telemetry_dropped_events_total", table=table, reason=reason)
