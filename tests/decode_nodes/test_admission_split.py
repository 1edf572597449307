"""A split prefill (``TransferParams.split``): the node reports the peer's prefix as loaded synchronously, so
vLLM schedules the rest of the prompt in the same step, and hands the worker a layer-wise, synchronous
receive; params that ask for it without a layer-wise prefix stay an ordinary (asynchronous) pull."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

from contracts.transfer import TransferParams, block_key
from kv_connector.scheduler import TandemScheduler
from kv_transfer.settings import ConnectorSettings

BS = 4


def _request(*, split: bool, layerwise: bool = True, prefix: int | None = 8) -> SimpleNamespace:
    hashes = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(20 // BS)]
    params = TransferParams(
        transfer_id="lw-1",
        remote_block_ids=[],
        remote_endpoints={"tcp": "tcp://127.0.0.1:9"},
        remote_host_id="h",
        remote_engine_id="peer",
        remote_num_tokens=0,
        lease_deadline=1e10,
        layerwise=layerwise,
        prefix_tokens=prefix,
        prefix_key=None if prefix is None else block_key(hashes[prefix // BS - 1]),
        split=split,
    ).to_dict()
    return SimpleNamespace(
        request_id="r1", prompt_token_ids=list(range(20)), kv_transfer_params=params, block_hashes=hashes
    )


def _alloc(sched: TandemScheduler, req: SimpleNamespace, n: int) -> None:
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14],)), n)


def test_a_split_prefix_is_loaded_in_step_and_pulled_by_position() -> None:
    sched = TandemScheduler(ConnectorSettings(port=9103), "engine-x", block_size=BS)
    req = _request(split=True)
    assert sched.get_num_new_matched_tokens(req, 0) == (8, False)  # synchronous: scheduled at once
    _alloc(sched, req, 8)
    [recv] = sched.build_connector_meta().recvs
    assert recv.split and recv.layerwise
    assert recv.remote_block_ids == [0, 1] and recv.local_block_ids == [10, 11]
    assert "split" in req.kv_transfer_params  # the params say it, and to_dict keeps it


def test_split_without_a_layerwise_prefix_is_an_ordinary_pull() -> None:
    for req in (_request(split=True, layerwise=False), _request(split=True, prefix=None)):
        sched = TandemScheduler(ConnectorSettings(port=9103), "engine-x", block_size=BS)
        count, asynchronous = sched.get_num_new_matched_tokens(req, 0)
        assert count > 0 and asynchronous
        _alloc(sched, req, count)
        [recv] = sched.build_connector_meta().recvs
        assert not recv.split


def test_unsplit_params_leave_split_out_of_the_dict() -> None:
    assert "split" not in _request(split=False).kv_transfer_params
    assert TransferParams.from_dict(_request(split=True).kv_transfer_params).split
