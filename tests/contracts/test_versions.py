"""Every versioned contract between processes is checked where it is read, with an error that names the
contract and both versions: the transfer params and report (``contracts.transfer``) and the registry
schema (``contracts.registry``; its entries are skipped and counted, never fatal to a reader). The wire
protocol's check is in ``tests/kv_transfer/test_wire_versions.py``."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest
import redis.asyncio as aioredis

from contracts.errors import UpstreamError, VersionMismatch
from contracts.registry import (
    NODES_SET,
    REGISTRY_SCHEMA_VERSION,
    LiveNode,
    NodeInfo,
    NodeLoad,
    NodeRegistry,
    Role,
    load_key,
    node_key,
)
from contracts.transfer import PARAMS_VERSION, TransferParams, TransferReport

REDIS_URL = "redis://127.0.0.1:6379/12"


def _params(**over: object) -> dict:
    base = TransferParams(
        transfer_id="t1",
        remote_block_ids=[3, 4],
        remote_endpoints={"tcp": "tcp://127.0.0.1:1"},
        remote_host_id="h",
        remote_engine_id="e",
        remote_num_tokens=20,
        lease_deadline=1e10,
    ).to_dict()
    return {**base, **over}


# -- transfer params and reports ---------------------------------------------------------------------------
def test_params_round_trip_through_their_dict() -> None:
    params = _params(transport="shm")
    assert params["tandem"] == PARAMS_VERSION and params["do_remote_prefill"] is True
    assert TransferParams.from_dict(params).to_dict() == params
    assert "transport" not in _params()  # absent, as before the params were typed


@pytest.mark.parametrize("version", [PARAMS_VERSION + 1, 0, None])
def test_params_of_another_version_are_a_clear_error(version: object) -> None:
    params = _params(tandem=version) if version is not None else {k: v for k, v in _params().items() if k != "tandem"}
    with pytest.raises(VersionMismatch) as err:
        TransferParams.from_dict(params)
    assert err.value.message.startswith(f"kv_transfer_params version {version!r} is not ours ({PARAMS_VERSION})")
    assert (err.value.theirs, err.value.ours) == (version, PARAMS_VERSION)


def test_malformed_params_of_our_version_are_an_upstream_error() -> None:
    with pytest.raises(UpstreamError, match="malformed kv_transfer_params.*remote_block_ids"):
        TransferParams.from_dict(_params(remote_block_ids="all of them"))


def test_a_report_of_another_version_is_a_clear_error_and_one_without_a_version_is_v1() -> None:
    report = TransferReport(ok=True, bytes=10, source="prefill", state="done").to_dict()
    assert TransferReport.from_dict(report) == TransferReport(ok=True, bytes=10, source="prefill", state="done")
    assert TransferReport.from_dict({"ok": False, "reason": "x"}).reason == "x"  # a report of before the types
    with pytest.raises(VersionMismatch, match=rf"transfer report version 7 is not ours \({PARAMS_VERSION}\)"):
        TransferReport.from_dict({**report, "tandem": 7})


# -- the registry ----------------------------------------------------------------------------------------
def _info(node_id: str, **over: object) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=Role.BOTH,
        model="m",
        url="http://127.0.0.1:1",
        block_size=16,
        max_model_len=2048,
        kv_connector="none",
        **over,
    )  # type: ignore[arg-type]


@pytest.fixture
async def redis12():
    client = aioredis.from_url(REDIS_URL)
    await client.flushdb()
    yield client
    await client.flushdb()
    await client.aclose()


async def _put_raw(client: aioredis.Redis, node_id: str, info: bytes, load: bytes | None = None) -> None:
    await client.set(node_key(node_id), info, px=60_000)
    if load is not None:
        await client.set(load_key(node_id), load, px=60_000)
    await client.sadd(NODES_SET, node_id)


async def test_a_newer_schema_entry_is_skipped_counted_and_named_and_the_others_still_listed(
    redis12: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    registry = NodeRegistry(redis12)
    await registry.register(_info("good"))
    newer = msgspec.msgpack.encode({**msgspec.to_builtins(_info("newer")), "schema_version": 99, "shape": [1]})
    await _put_raw(redis12, "newer", newer)
    with caplog.at_level(logging.WARNING, logger="tandem.registry"):
        assert [n.info.node_id for n in await registry.live_nodes()] == ["good"]
        assert [n.info.node_id for n in await registry.live_nodes()] == ["good"]
    assert registry.skipped == {"version": 2}
    [line] = [r.getMessage() for r in caplog.records]  # logged once, counted at every read
    assert f"node newer skipped: registry schema version 99 is not ours ({REGISTRY_SCHEMA_VERSION})" in line


async def test_a_v1_entry_still_reads(redis12: aioredis.Redis) -> None:
    registry = NodeRegistry(redis12)
    v1 = {k: v for k, v in msgspec.to_builtins(_info("old")).items() if k != "epoch"} | {"schema_version": 1}
    await _put_raw(redis12, "old", msgspec.msgpack.encode(v1))
    [node] = await registry.live_nodes()
    assert node.info.node_id == "old" and node.info.epoch == 0 and not registry.skipped


async def test_malformed_entries_are_skipped_and_counted(redis12: aioredis.Redis) -> None:
    registry = NodeRegistry(redis12)
    await registry.register(_info("good"), NodeLoad(running=1))
    await _put_raw(redis12, "garbage", b"\xc1 not msgpack")
    await _put_raw(redis12, "no-role", msgspec.msgpack.encode({"node_id": "no-role", "model": "m"}))
    await _put_raw(redis12, "bad-load", msgspec.msgpack.encode(_info("bad-load")), load=b"\x00\x01")
    [node] = await registry.live_nodes()
    assert node.info.node_id == "good" and node.load.running == 1
    assert registry.skipped == {"malformed": 3}


async def test_a_malformed_entry_does_not_stop_the_routers_fleet_refresh(redis12: aioredis.Redis) -> None:
    """The router's refresh task keeps running past a bad entry and still sees nodes that join after it."""
    from router.fleet import Fleet

    registry = NodeRegistry(redis12)
    views: asyncio.Queue[list[str]] = asyncio.Queue()

    async def on_refresh(nodes: list[LiveNode]) -> None:
        await views.put(sorted(n.info.node_id for n in nodes))

    fleet = Fleet(registry, refresh_s=0.01, on_refresh=on_refresh)
    await registry.register(_info("a"))
    await fleet.start()
    try:
        assert await asyncio.wait_for(views.get(), 10) == ["a"]
        await _put_raw(redis12, "bad", b"\xc1")
        await _put_raw(redis12, "newer", msgspec.msgpack.encode({"schema_version": REGISTRY_SCHEMA_VERSION + 1}))
        await registry.register(_info("b"))
        while (view := await asyncio.wait_for(views.get(), 10)) != ["a", "b"]:
            assert set(view) <= {"a", "b"}
        assert await asyncio.wait_for(views.get(), 10) == ["a", "b"]  # and it goes on refreshing
        assert fleet._own_loop is not None and fleet._own_loop.running
        assert fleet.skipped_entries["malformed"] >= 1 and fleet.skipped_entries["version"] >= 1
        assert [n.info.node_id for n in fleet.nodes] == ["a", "b"]
    finally:
        await fleet.stop()
