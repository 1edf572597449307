"""The peer's plumbing: its command line, and the relay that moves an ipc KV-event stream onto tcp."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

from bench.vllm_router import EventRelay, PeerWorker, VllmRouter


def test_kv_aware_command_names_every_event_source() -> None:
    workers = [
        PeerWorker(f"http://127.0.0.1:{p}", f"tcp://127.0.0.1:{p + 1}", f"tcp://127.0.0.1:{p + 2}")
        for p in (9100, 9110)
    ]
    cmd = VllmRouter(9000, "kv_aware", workers, 128, "m", Path("/dev/null")).command("vllm-router")
    assert cmd[cmd.index("--policy") + 1] == "kv_aware" and cmd[cmd.index("--kv-event-block-size") + 1] == "128"
    assert "http://127.0.0.1:9110=tcp://127.0.0.1:9111" in cmd and "http://127.0.0.1:9100=tcp://127.0.0.1:9102" in cmd
    plain = VllmRouter(9000, "cache_aware", workers, 128, "m", Path("/dev/null")).command("vllm-router")
    assert not any(a.startswith("--kv-event") for a in plain)


def test_relay_forwards_frames_unchanged(tmp_path: Path) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/ev.sock")
    frames = [b"kv-events", (7).to_bytes(8, "big"), b"payload"]
    try:
        with EventRelay(f"ipc://{tmp_path}/ev.sock", 19_987) as relay:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(relay.endpoint)
            deadline = time.monotonic() + 10
            got = None
            while got is None and time.monotonic() < deadline:  # PUB/SUB joins late: publish until heard
                pub.send_multipart(frames)
                if sub.poll(50):
                    got = sub.recv_multipart()
            sub.close(linger=0)
        assert got == frames
    finally:
        pub.close(linger=0)
        ctx.term()
