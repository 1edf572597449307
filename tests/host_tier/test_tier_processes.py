"""The host tier as deployed: ``tandem tier serve`` in its own process, clients in others, the blocks in
a shared file that outlives the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from contracts.errors import ConfigError
from host_tier.client import TierClient
from host_tier.events import MEDIUM, event_key
from host_tier.settings import TierSettings, layout_from_model
from tests.support.helpers import tier_serve_command

CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": 3}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


class Tier:
    def __init__(self, tmp: Path, model: Path, n_blocks: int) -> None:
        self.env = {
            **os.environ,
            "TANDEM_TIER_DIR": str(tmp),
            "TANDEM_TIER_ENDPOINT": f"ipc://{tmp}/tier.sock",
            "TANDEM_TIER_EVENTS_ENDPOINT": f"ipc://{tmp}/events.sock",
        }
        self.layout = layout_from_model(model, "float32", 16)
        self.settings = TierSettings(dir=tmp, endpoint=self.env["TANDEM_TIER_ENDPOINT"])
        self.args = tier_serve_command(model, "float32", 16, n_blocks * self.layout.block_bytes)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, env=self.env)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def client(self) -> TierClient:
        # REQ connects before the server binds; the first call waits for it (no sleep, a bounded wait).
        return TierClient(self.settings.endpoint, self.layout.fingerprint(), timeout_s=30.0)


@pytest.fixture
def tier(tmp_path: Path, model: Path) -> Iterator[Tier]:
    t = Tier(tmp_path, model, n_blocks=8)
    t.start()
    yield t
    if t.proc is not None and t.proc.poll() is None:
        t.proc.terminate()
        t.proc.wait(timeout=10)


def blocks(tier: Tier, n: int, seed: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(32) for _ in range(n)]
    data = [rng.integers(0, 256, tier.layout.block_bytes, dtype=np.uint8) for _ in range(n)]
    return keys, data


WRITER = """
import sys, numpy as np
from host_tier.client import TierClient
endpoint, fp = sys.argv[1], bytes.fromhex(sys.argv[2])
seed, n, size = (int(a) for a in sys.argv[3:6])
rng = np.random.default_rng(seed)
keys = [rng.bytes(32) for _ in range(n)]
data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
print(TierClient(endpoint, fp, timeout_s=30.0).put(keys, data))
"""


def test_blocks_one_process_offloads_another_loads_verified(tier: Tier) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            WRITER,
            tier.settings.endpoint,
            tier.layout.fingerprint().hex(),
            "7",
            "3",
            str(tier.layout.block_bytes),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=tier.env,
    )
    assert out.stdout.strip() == "3"
    keys, data = blocks(tier, 3, seed=7)
    client = tier.client()
    got = client.get(keys)
    assert isinstance(got, list) and [g == d.tobytes() for g, d in zip(got, data, strict=True)] == [True] * 3
    dest = [np.zeros(tier.layout.block_bytes, dtype=np.uint8) for _ in range(3)]
    assert client.get(keys, out=dest) == 3 and all((a == b).all() for a, b in zip(dest, data, strict=True))
    assert client.put(keys, data) == 0  # already held: nothing rewritten


def test_a_corrupted_block_is_detected_forgotten_and_the_chain_stops_there(tier: Tier) -> None:
    client = tier.client()
    keys, data = blocks(tier, 3, seed=1)
    assert client.put(keys, data) == 3
    held = client.get(keys)
    assert isinstance(held, list) and len(held) == 3
    arena = client.arena
    for slot in range(arena.n_slots):  # flip one byte of the second block in the shared file
        if arena.read(slot, keys[1]) is not None:
            arena.data(slot)[123] ^= 0x55
    got = client.get(keys)
    assert isinstance(got, list) and len(got) == 1  # the first block only: the caller recomputes the rest
    stats = client.stats()
    assert stats.forgotten == {"corrupt": 1} and stats.held == 2
    assert client.lookup(keys) == 1


def test_the_blocks_outlive_a_killed_server(tier: Tier) -> None:
    client = tier.client()
    keys, data = blocks(tier, 4, seed=2)
    assert client.put(keys, data) == 4
    client.close()
    tier.kill()
    tier.start()
    again = tier.client()
    got = again.get(keys)
    assert isinstance(got, list) and [g == d.tobytes() for g, d in zip(got, data, strict=True)] == [True] * 4
    assert again.stats().held == 4


def test_the_tier_is_bounded_and_publishes_what_it_stores_and_removes(tier: Tier) -> None:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(tier.env["TANDEM_TIER_EVENTS_ENDPOINT"])
    client = tier.client()
    # A SUB socket receives only after its subscription reached the publisher: offload one block at a
    # time until its event arrives, then everything after it is seen in order.
    seed = 100
    while True:
        k, d = blocks(tier, 1, seed=seed)
        client.put(k, d)
        if sub.poll(200):
            sub.recv_multipart()
            break
        seed += 1
        assert seed < 150, "no event arrived"
    held_before = client.stats().held
    keys, data = blocks(tier, 8, seed=3)
    assert client.put(keys, data) == 8
    stats = client.stats()
    assert stats.held == 8 and sum(stats.evictions.values()) == held_before  # bounded: 8 slots
    stored, removed = set(), set()
    while len(stored) < 8 or len(removed) < held_before:
        assert sub.poll(5000), "events missing"
        _, _, payload = sub.recv_multipart()
        ts, events, _ = msgspec.msgpack.decode(payload)
        for ev in events:
            assert ev["medium"] == MEDIUM
            (stored if ev["type"] == "BlockStored" else removed).update(ev["block_hashes"])
    assert stored == {event_key(k) for k in keys}
    sub.close()


def test_a_client_of_another_layout_is_refused_with_a_clear_error(tier: Tier, model: Path) -> None:
    other = layout_from_model(model, "bfloat16", 16)
    with pytest.raises(ConfigError, match="another layout"):
        TierClient(tier.settings.endpoint, other.fingerprint(), timeout_s=30.0)
