"""The emitter never blocks the caller, bounds everything, and counts every drop."""

from __future__ import annotations

import asyncio
import linecache
import socket
import sys
import threading
import time

import pyarrow as pa
import redis

from telemetry.emitter import stream_key
from tests.telemetry.conftest import closed_port, dropped, sample, wait_until


def _read_stream(r: redis.Redis, key: str) -> pa.Table:
    tables = [pa.ipc.open_stream(pa.py_buffer(f[b"a"])).read_all() for _, f in r.xrange(key)]
    return pa.concat_tables(tables) if tables else pa.table({})


def test_events_reach_the_stream_with_ids_and_times(make_emitter, r, prefix, metrics):
    e = make_emitter(batch_size=100, flush_interval_s=0.05)
    before = time.time()
    for i in range(250):
        assert e.emit("requests", {"request_id": f"r{i}", "prompt_tokens": i, "t_arrival": before})
    e.emit("feedback", {"response_id": "chatcmpl-1", "rating": 1, "labels": ["good", "fast"]})
    e.close()
    req = _read_stream(r, stream_key(prefix, "requests"))
    assert req.num_rows == 250
    assert sorted(req.column("prompt_tokens").to_pylist()) == list(range(250))
    ids = req.column("event_id").to_pylist()
    assert len(set(ids)) == 250 and all(ids)
    times = [t.timestamp() for t in req.column("event_time").to_pylist()]
    assert all(before - 1 <= t <= time.time() + 1 for t in times)
    assert abs(req.column("t_arrival")[0].as_py().timestamp() - before) < 1e-3
    assert set(req.column("source").to_pylist()) == {"test"}
    fb = _read_stream(r, stream_key(prefix, "feedback"))
    assert fb.column("labels").to_pylist() == [["good", "fast"]]
    assert sample(metrics, "tandem_telemetry_sent_events_total", table="requests") == 250


def test_redis_unreachable_never_blocks_and_counts_drops(make_emitter, metrics):
    e = make_emitter(
        redis_url=f"redis://127.0.0.1:{closed_port()}/0", batch_size=50, flush_interval_s=0.01, capacity=1000
    )
    worst = 0.0
    for i in range(3000):
        t = time.perf_counter()
        ok = e.emit("requests", {"request_id": f"r{i}"})
        worst = max(worst, time.perf_counter() - t)
        assert isinstance(ok, bool)
    assert worst < 0.05, f"emit took {worst * 1e3:.1f} ms"
    t = time.perf_counter()
    e.close(timeout_s=5)
    assert time.perf_counter() - t < 10
    lost = dropped(metrics, "requests", "redis_unavailable") + dropped(metrics, "requests", "buffer_full")
    assert dropped(metrics, "requests", "redis_unavailable") > 0
    assert lost == 3000
    assert sample(metrics, "tandem_telemetry_sent_events_total", table="requests") == 0


def test_emit_stays_fast_while_the_flusher_hangs_on_redis(make_emitter, metrics):
    # A server that accepts connections and never answers: the flusher blocks in a read.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    port = srv.getsockname()[1]
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except TimeoutError:
                continue

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        e = make_emitter(
            redis_url=f"redis://127.0.0.1:{port}/0",
            batch_size=10,
            flush_interval_s=0.01,
            capacity=200,
            socket_timeout_s=3.0,
        )
        e.emit("requests", {"request_id": "first"})
        wait_until(lambda: len(conns) > 0, what="the flusher to connect")
        worst = 0.0
        results = []
        for i in range(1000):
            t = time.perf_counter()
            results.append(e.emit("requests", {"request_id": f"r{i}"}))
            worst = max(worst, time.perf_counter() - t)
        assert worst < 0.05, f"emit took {worst * 1e3:.1f} ms while the flusher was stuck"
        assert results.count(False) >= 1000 - 200
        assert dropped(metrics, "requests", "buffer_full") == results.count(False)
        assert e.queue_length() <= 200
    finally:
        stop.set()
        th.join()
        for c in conns:
            c.close()
        srv.close()


def test_full_buffer_drops_and_counts(make_emitter, r, prefix, metrics):
    e = make_emitter(start=False, capacity=10, batch_size=100)
    results = [e.emit("requests", {"request_id": f"r{i}"}) for i in range(25)]
    assert results == [True] * 10 + [False] * 15
    assert dropped(metrics, "requests", "buffer_full") == 15
    assert e.queue_length() == 10
    assert e.flush() == 10
    assert metrics.telemetry_queue_length._value.get() == 0  # noqa: SLF001
    assert _read_stream(r, stream_key(prefix, "requests")).num_rows == 10


def test_full_stream_refuses_new_batches_and_counts(make_emitter, r, prefix, metrics):
    e = make_emitter(start=False, batch_size=10, stream_maxlen=2)
    for i in range(50):
        assert e.emit("requests", {"request_id": f"r{i}"})
    assert e.flush() == 20
    assert r.xlen(stream_key(prefix, "requests")) == 2
    assert dropped(metrics, "requests", "stream_full") == 30
    # The oldest (unread) batches are kept, not trimmed.
    got = _read_stream(r, stream_key(prefix, "requests")).column("request_id").to_pylist()
    assert got == [f"r{i}" for i in range(20)]


def test_invalid_records_are_counted_and_the_rest_kept(make_emitter, r, prefix, metrics):
    e = make_emitter(start=False, batch_size=100)
    assert e.emit("no_such_table", {"x": 1}) is False
    assert dropped(metrics, "unknown", "invalid") == 1
    e.emit("requests", {"request_id": "good-1", "prompt_tokens": 5})
    e.emit("requests", {"request_id": "bad", "prompt_tokens": "many"})
    e.emit("requests", {"request_id": "good-2", "t_finish": "yesterday"})
    e.emit("requests", {"request_id": "good-3", "prompt_tokens": 7})
    assert e.flush() == 2
    assert dropped(metrics, "requests", "invalid") == 2
    got = _read_stream(r, stream_key(prefix, "requests")).column("request_id").to_pylist()
    assert got == ["good-1", "good-3"]


def test_emit_after_close_is_dropped(make_emitter, metrics):
    e = make_emitter()
    e.close()
    assert e.emit("errors", {"message": "late"}) is False
    assert dropped(metrics, "errors", "closed") == 1


async def test_works_from_asyncio(make_emitter, r, prefix):
    e = make_emitter(batch_size=5, flush_interval_s=0.02)

    async def handler(i: int) -> None:
        e.emit("errors", {"component": "router", "message": f"m{i}"})
        await asyncio.sleep(0)

    await asyncio.gather(*(handler(i) for i in range(40)))
    await e.aclose()
    got = _read_stream(r, stream_key(prefix, "errors")).column("message").to_pylist()
    assert sorted(got) == sorted(f"m{i}" for i in range(40))


def _flusher_sleeps_until_an_event(e) -> bool:  # noqa: ANN001
    """The flusher thread is blocked in the idle wait (``_arrived``), not in a timed batching wait."""
    frame = sys._current_frames().get(e._thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "_run":
            return "self._arrived.wait()" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return False


def test_an_idle_flusher_sleeps_until_the_first_event_then_sends_it(make_emitter, r, prefix):
    # An idle router or node must not wake every flush interval: on a CPU host any wake-up can stall
    # an engine's forward pass. The flusher sleeps on emit's signal and still sends within the interval.
    e = make_emitter(flush_interval_s=0.05)
    wait_until(lambda: _flusher_sleeps_until_an_event(e), 10, "the idle wait")
    e.emit("requests", {"request_id": "r0"})
    key = stream_key(prefix, "requests")
    wait_until(lambda: r.xlen(key) == 1, 10, "the event in the stream")
    wait_until(lambda: _flusher_sleeps_until_an_event(e), 10, "the idle wait again")  # once it is sent


def test_a_redis_that_lost_its_scripts_still_gets_the_batch_once(make_emitter, r, prefix, metrics):
    # A restarted or flushed Redis forgets the XADD script: it is loaded again and the batch sent once.
    e = make_emitter(start=False)
    r.script_flush()
    for i in range(3):
        e.emit("requests", {"request_id": f"r{i}"})
    assert e.flush() == 3
    assert _read_stream(r, stream_key(prefix, "requests")).num_rows == 3
    assert r.xlen(stream_key(prefix, "requests")) == 1
