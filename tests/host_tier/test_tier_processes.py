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

import httpx
import msgspec
import numpy as np
import pytest
import zmq

from contracts.errors import ConfigError
from host_tier import messages as m
from host_tier.client import TierClient
from host_tier.events import MEDIUM, event_key
from host_tier.settings import TierSettings, layout_from_model
from tests.support.helpers import tier_serve_command, wait_for

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
            "TANDEM_TIER_REPLAY_ENDPOINT": f"ipc://{tmp}/replay.sock",
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
from host_tier import messages as m
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


def _stored(frames: list[bytes]) -> set[int]:
    _, events, _ = msgspec.msgpack.decode(frames[2])
    return {h for ev in events if ev["type"] == "BlockStored" for h in ev["block_hashes"]}


def test_the_tier_is_bounded_and_publishes_what_it_stores_and_removes(tier: Tier) -> None:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(tier.env["TANDEM_TIER_EVENTS_ENDPOINT"])
    client = tier.client()
    # A SUB socket receives only after its subscription reached the publisher: offload one block at a
    # time until its event arrives, then everything after it is seen in order.
    seed, seeds = 100, set()
    while True:
        k, d = blocks(tier, 1, seed=seed)
        client.put(k, d)
        seeds.add(event_key(k[0]))
        # (the tier also publishes empty heartbeat batches, and its start-up snapshot)
        if sub.poll(200) and event_key(k[0]) in _stored(sub.recv_multipart()):
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
            if ev["type"] == "AllBlocksCleared":  # the snapshot the tier publishes at start (seq 0)
                continue
            assert ev["medium"] == MEDIUM
            (stored if ev["type"] == "BlockStored" else removed).update(ev["block_hashes"])
    assert stored - seeds == {event_key(k) for k in keys}  # (a late seed's event may come after)
    sub.close()


def test_a_client_of_another_layout_is_refused_with_a_clear_error(tier: Tier, model: Path) -> None:
    other = layout_from_model(model, "bfloat16", 16)
    with pytest.raises(ConfigError, match="another layout"):
        TierClient(tier.settings.endpoint, other.fingerprint(), timeout_s=30.0)


async def test_the_router_index_follows_the_tier_from_a_snapshot_through_restart_and_eviction(tier: Tier) -> None:
    """The router's own subscriber manager, given a node whose registry entry names the tier (as a node
    agent writes it, from the tier's ``Welcome``): it learns what the tier held before it subscribed
    (a snapshot replay), what it stores after, what a restarted tier recovered from its file, and
    what it evicts."""
    import zmq.asyncio

    from contracts.registry import LiveNode, NodeInfo, NodeLoad, Role
    from host_tier.client import tier_endpoints
    from router.kv_index.block_keys import external_key
    from router.kv_index.index import FleetIndex
    from router.kv_index.subscriber import KVEventSubscribers
    from tests.support.zmq_helpers import until

    client = tier.client()
    keys, data = blocks(tier, 3, seed=11)
    assert client.put(keys, data) == 3
    events_ep, replay_ep = tier_endpoints(tier.settings.endpoint)
    assert (events_ep, replay_ep) == (tier.env["TANDEM_TIER_EVENTS_ENDPOINT"], tier.env["TANDEM_TIER_REPLAY_ENDPOINT"])
    info = NodeInfo(
        node_id="n0",
        role=Role.BOTH,
        model="m",
        url="http://127.0.0.1:1",
        block_size=16,
        max_model_len=4096,
        kv_connector="none",
        host_tier_events_endpoint=events_ep,
        host_tier_replay_endpoint=replay_ep,
    )
    fleet = FleetIndex()
    ctx = zmq.asyncio.Context()
    subs = KVEventSubscribers(fleet, ctx=ctx)
    await subs.sync([LiveNode(info=info, load=NodeLoad())])
    more_keys, more = blocks(tier, 2, seed=12)
    chain = [external_key(k) for k in keys + more_keys]
    try:
        await until(lambda: fleet.split("m", chain, "n0") == (0, 3), what="the snapshot of what the tier held")
        assert client.put(more_keys, more) == 2
        await until(lambda: fleet.split("m", chain, "n0") == (0, 5), what="live store events")
        client.close()
        tier.kill()
        tier.start()
        again = tier.client()
        # the restarted tier publishes from seq 0 again: the router re-learns what its file held (the
        # first offload after the restart makes sure a live batch reaches the subscriber)
        extra_keys, extra = blocks(tier, 1, seed=13)
        assert again.put(extra_keys, extra) == 1
        index = fleet.model("m", 16)
        (tier_id,) = subs.stats()
        await until(lambda: index.block_counts().get(tier_id) == 6, what="the restarted tier's blocks")
        assert fleet.split("m", chain, "n0") == (0, 5)
        others, other_data = blocks(tier, 8, seed=14)  # a tier of 8 slots: everything before is evicted
        assert again.put(others, other_data) == 8
        await until(lambda: fleet.split("m", chain, "n0") == (0, 0), what="eviction events")
        again.close()
    finally:
        await subs.close()
        ctx.destroy(linger=0)


def test_metrics_show_what_the_tier_holds_and_clear_gives_the_ram_back_only_when_unused(
    tmp_path: Path, model: Path
) -> None:
    from bench.standin_engine import free_port
    from tests.support.helpers import wait_for

    port = free_port()
    t = Tier(tmp_path, model, n_blocks=4)
    t.env["TANDEM_TIER_METRICS_PORT"] = str(port)
    t.start()
    try:
        client = t.client()
        keys, data = blocks(t, 6, seed=21)  # 6 into 4 slots: 2 evicted
        assert client.put(keys[:4], data[:4]) == 4 and client.put(keys[4:], data[4:]) == 2
        client.pin(keys[-2:], 60.0, owner="s", tenant="a")

        def scrape() -> str:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.HTTPError:
                return ""

        # the exporter shows a snapshot the tier's loop takes once a second
        assert wait_for(lambda: "tandem_tier_stored_total 6.0" in scrape(), timeout_s=30), scrape()
        text = scrape()
        assert 'tandem_tier_blocks{state="held"} 4.0' in text
        assert 'tandem_tier_evictions_total{reason="lru"} 2.0' in text
        assert f"tandem_tier_pinned_bytes {2 * t.layout.block_bytes}.0" in text
        client.close()
        # another cluster's tier on the same host: never this cluster's to clear
        other = tmp_path / f"tandem-tier-other-{'ab' * 8}"
        other.write_bytes(b"x")
        clear = [sys.executable, "-m", "tandem", "tier", "clear", "--dir", str(tmp_path)]
        kept = subprocess.run(clear, capture_output=True, text=True, env=t.env)
        assert kept.returncode == 1 and "mapped by pid" in kept.stdout  # the running tier maps it
        assert list(tmp_path.glob("tandem-tier-*"))
    finally:
        t.kill()
    removed = subprocess.run(clear, capture_output=True, text=True, env=t.env)
    assert removed.returncode == 0 and "removed" in removed.stdout, removed.stdout + removed.stderr
    assert list(tmp_path.glob("tandem-tier-*")) == [other]
    everyone = subprocess.run([*clear, "--all-clusters"], capture_output=True, text=True, env=t.env)
    assert everyone.returncode == 0 and "removed" in everyone.stdout, everyone.stdout
    assert not list(tmp_path.glob("tandem-tier-*"))


def test_the_tier_emits_host_tier_rows_the_lake_writer_writes_and_they_sum_to_its_counters(
    tmp_path: Path, model: Path
) -> None:
    """A real tier with telemetry on, the real Redis (DB 3, a stream prefix of its own, as the telemetry
    tests use) and the real lake writer into a tmp lake: rows arrive while the tier runs, and its last
    interval's row arrives when it is stopped, so the lake sums to what the tier counted."""
    import time
    import uuid

    import redis

    from telemetry.lake_writer import LakeWriter, WriterConfig
    from telemetry.query import query
    from tests.support.helpers import wait_for

    redis_url, prefix = "redis://127.0.0.1:6379/3", f"tandem:test:{uuid.uuid4().hex[:12]}"
    t = Tier(tmp_path, model, n_blocks=4)
    t.env |= {
        "TANDEM_TIER_TELEMETRY_REDIS_URL": redis_url,
        "TANDEM_TIER_TELEMETRY_STREAM_PREFIX": prefix,
        "TANDEM_TIER_TELEMETRY_INTERVAL_S": "0.5",  # a row at (about) every sweep of the loop, once a second
    }
    lake = tmp_path / "lake"
    writer = LakeWriter(WriterConfig(lake=lake, redis_url=redis_url, stream_prefix=prefix, consumer="t"))
    r = redis.Redis.from_url(redis_url)

    def lake_sum(column: str) -> int:
        writer.drain()
        if not list(lake.glob("host_tier/**/*.parquet")):
            return -1
        return int(query(lake, f"SELECT coalesce(sum({column}), 0) AS n FROM host_tier").to_pylist()[0]["n"])

    t.start()
    try:
        client = t.client()
        keys, data = blocks(t, 6, seed=31)  # 6 into 4 slots: 2 evicted, least recently used first
        assert client.put(keys[:3], data[:3]) == 3
        assert wait_for(lambda: lake_sum("stored") == 3, timeout_s=30), lake_sum("stored")
        assert client.put(keys[3:], data[3:]) == 3
        assert len(client.get(keys[2:]) or []) == 4  # the 4 held: hits
        client.close()
        assert t.proc is not None
        stopped_at = time.time()
        t.proc.terminate()  # SIGTERM: the loop ends, its last interval's row is flushed on the way out
        assert t.proc.wait(timeout=30) == 0
        assert wait_for(lambda: lake_sum("stored") == 6 and lake_sum("hits") == 4, timeout_s=30), lake_sum("hits")
        assert lake_sum("evicted_lru") == 2 and lake_sum("evicted_pinned_lru") == 0
        rows = query(
            lake, "SELECT tier_id, model, layout_fingerprint, slots, slot_bytes, blocks_held FROM host_tier"
        ).to_pylist()
        path = t.settings.path_for(t.layout)
        assert {(r["tier_id"].endswith(f":{path}"), r["model"], r["layout_fingerprint"]) for r in rows} == {
            (True, model.name, t.layout.fingerprint().hex())
        }
        assert {(r["slots"], r["slot_bytes"]) for r in rows} == {(4, t.layout.block_bytes)}
        last = query(
            lake, "SELECT epoch(interval_end) AS end_s, blocks_held FROM host_tier ORDER BY interval_end DESC LIMIT 1"
        ).to_pylist()
        assert last[0]["blocks_held"] == 4 and last[0]["end_s"] >= stopped_at  # the row of the stop itself
    finally:
        if t.proc is not None and t.proc.poll() is None:
            t.kill()
        writer.close()
        for k in r.scan_iter(f"{prefix}:*"):
            r.delete(k)
        r.close()


STALLED_WRITER = """
import sys
from host_tier import messages as m
from host_tier import messages as m
from host_tier.client import TierClient
client = TierClient(sys.argv[1], bytes.fromhex(sys.argv[2]), timeout_s=30.0)
keys = [bytes([i]) * 32 for i in range(int(sys.argv[3]))]
reserved = client._call(m.Reserve(keys))
slot = reserved.slots[0]
client.arena.begin_write(slot)  # half a write: the engine dies inside its copy
print(sum(s >= 0 for s in reserved.slots), flush=True)
sys.stdin.read()  # held until killed
"""


def test_an_engine_killed_inside_an_offload_leaves_no_tier_space_behind(tmp_path: Path, model: Path) -> None:
    t = Tier(tmp_path, model, n_blocks=8)
    t.env["TANDEM_TIER_WRITE_TIMEOUT_S"] = "1"
    t.start()
    writer = None
    try:
        client = t.client()
        writer = subprocess.Popen(
            [sys.executable, "-c", STALLED_WRITER, t.settings.endpoint, t.layout.fingerprint().hex(), "3"],
            env=t.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert writer.stdout is not None and writer.stdout.readline().strip() == b"3"
        assert client.stats().writing == 3
        writer.kill()
        writer.wait()
        # the dead writer's reservations are taken back (nothing committed, nothing readable) ...
        assert wait_for(lambda: client.stats().writing == 0, timeout_s=30), client.stats()
        stats = client.stats()
        assert (stats.reclaimed, stats.held) == (3, 0)
        assert client.lookup([bytes([0]) * 32]) == 0
        # ... and every slot is there for the next writer
        keys, data = blocks(t, 8, seed=11)
        assert client.put(keys, data) == 8
    finally:
        if writer is not None and writer.poll() is None:
            writer.kill()
        if t.proc is not None and t.proc.poll() is None:
            t.proc.terminate()
            t.proc.wait(timeout=10)


def test_a_demote_notice_is_answered_with_nothing_and_its_blocks_leave_first(tier: Tier) -> None:
    """What an engine sends once it has loaded blocks (``TierClient.demote``): no answer to
    wait for, and the tier's copies become the first to leave."""
    client = tier.client()
    keys, data = blocks(tier, 8)
    assert client.put(keys[:4], data[:4]) == 4
    assert client.put(keys[4:], data[4:]) == 4  # full: keys[0] is the least recently used
    client.demote(keys[4:6])
    # One connection keeps its order: the server's next message from it is this Stats, and the one frame
    # that comes back answers it (were the notice answered, a Done would come first).
    notices = client._notices
    assert notices is not None
    notices.send_multipart([b"", m.encoder.encode(m.Stats())])
    assert notices.poll(30_000)
    _, payload = notices.recv_multipart()
    assert isinstance(m.reply_decoder.decode(payload), m.TierStats)
    assert not notices.poll(0)
    new_keys, new_data = blocks(tier, 2, seed=1)
    assert client.put(new_keys, new_data) == 2
    assert client.lookup(keys[:4]) == 4  # without the notice, the least recently used would have left
    assert client.lookup(keys[4:5]) == 0 and client.lookup(keys[6:8]) == 2
    assert client.notices_dropped == 0
