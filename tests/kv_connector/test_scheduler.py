"""The connector's scheduler half on its own (stand-in requests and block lists; the real engine path is
covered end to end in tests/e2e): which requests get leases, pulls or releases, and what they carry."""

from __future__ import annotations

import time
from types import SimpleNamespace

from vllm.v1.request import RequestStatus

from contracts.transfer import TransferReport
from kv_connector.scheduler import TandemScheduler
from kv_transfer.settings import ConnectorSettings, host_id


def _sched(free_blocks: int = 1000) -> TandemScheduler:
    s = TandemScheduler(ConnectorSettings(port=9103, lease_s=30), "engine-p", block_size=4)
    s.kv_cache_manager = SimpleNamespace(block_pool=SimpleNamespace(get_num_free_blocks=lambda: free_blocks))
    return s


def _req(rid: str, n_tokens: int, params: dict | None, status=RequestStatus.FINISHED_LENGTH_CAPPED):  # noqa: ANN001, ANN202
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(range(n_tokens)),
        kv_transfer_params=params,
        status=status,
        num_computed_tokens=n_tokens,
    )


def _decode_params(p: TandemScheduler, rid: str = "r1", n_tokens: int = 10) -> dict:
    """What a prefill node's scheduler hands back for a finished prefill of ``n_tokens`` tokens."""
    delay, params = p.request_finished(_req(rid, n_tokens, {"do_remote_decode": True}), [7, 8, 9])
    assert delay is True
    return params


def test_prefill_side_leases_the_blocks_and_names_its_block_server() -> None:
    p = _sched()
    params = _decode_params(p)
    assert params["transfer_id"] == "r1" and params["remote_block_ids"] == [7, 8, 9]
    assert params["remote_endpoints"]["tcp"] == "tcp://127.0.0.1:9103" and params["remote_host_id"] == host_id()
    assert params["do_remote_prefill"] is True and params["lease_deadline"] > time.time() + 25
    meta = p.build_connector_meta()
    assert [(lease.transfer_id, lease.block_ids) for lease in meta.leases] == [("r1", [7, 8, 9])]
    assert p.build_connector_meta().empty()


def test_aborted_prefill_frees_at_once() -> None:
    p = _sched()
    assert p.request_finished(
        _req("r1", 10, {"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED), [7, 8, 9]
    ) == (False, None)
    assert p.build_connector_meta().empty()


def _blocks(local_cached: list[int], new: list[int]) -> SimpleNamespace:
    blocks = [SimpleNamespace(block_id=b, block_hash=b"h", is_null=False) for b in local_cached]
    blocks += [SimpleNamespace(block_id=b, block_hash=None, is_null=False) for b in new]
    return SimpleNamespace(
        blocks=(blocks,),
        get_unhashed_block_ids_all_groups=lambda: [new],
        get_block_ids=lambda: ([*local_cached, *new],),
    )


def test_decode_side_pulls_only_the_blocks_its_own_cache_lacks_aligned_by_position() -> None:
    params = _decode_params(_sched())
    d = _sched()
    req = _req("d1", 10, dict(params))
    assert d.get_num_new_matched_tokens(req, 4) == (6, True)  # one block of 4 tokens cached locally
    d.update_state_after_alloc(req, _blocks([0], [3, 4]), 6)
    (recv,) = d.build_connector_meta().recvs
    assert recv.remote_block_ids == [8, 9] and recv.local_block_ids == [3, 4] and recv.transfer_id == "r1"
    assert req.kv_transfer_params["do_remote_prefill"] is False  # one transfer per request


def test_decode_without_room_releases_the_lease_and_prefills_itself() -> None:
    params = _decode_params(_sched())
    d = _sched(free_blocks=2)
    req = _req("d1", 10, dict(params))
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    (rel,) = d.build_connector_meta().releases
    assert rel.transfer_id == "r1" and "no room" in rel.reason
    assert d.get_num_new_matched_tokens(req, 0) == (0, False) and d.build_connector_meta().empty()


def test_full_local_hit_past_lease_and_abort_before_scheduling_each_release_once() -> None:
    d = _sched()
    hit = _req("d1", 10, dict(_decode_params(_sched())))
    d.update_state_after_alloc(hit, _blocks([0, 1, 2], []), 0)
    late = _req("d2", 10, {**_decode_params(_sched(), "r2"), "lease_deadline": time.time() - 1})
    assert d.get_num_new_matched_tokens(late, 0) == (0, False)
    gone = _req("d3", 10, dict(_decode_params(_sched(), "r3")), RequestStatus.FINISHED_ABORTED)
    assert d.request_finished(gone, []) == (False, None)
    reasons = {r.transfer_id: r.reason for r in d.build_connector_meta().releases}
    assert set(reasons) == {"r1", "r2", "r3"}
    assert "cached" in reasons["r1"] and "past" in reasons["r2"] and "ended" in reasons["r3"]


def test_abort_during_pull_cancels_it_and_a_finished_pull_reports_back() -> None:
    d = _sched()
    req = _req("d1", 10, dict(_decode_params(_sched())), RequestStatus.FINISHED_ABORTED)
    d.update_state_after_alloc(req, _blocks([], [3, 4, 5]), 10)
    d.build_connector_meta()
    assert d.request_finished(req, [3, 4, 5]) == (False, None)
    assert d.build_connector_meta().cancels == ["d1"]
    ok = _req("d2", 10, dict(_decode_params(_sched(), "r2")), RequestStatus.FINISHED_STOPPED)
    d.update_state_after_alloc(ok, _blocks([], [6, 7, 8]), 10)
    d.update_connector_output({"d2"}, {"d2": TransferReport(ok=True, bytes=123)})
    delay, params = d.request_finished(ok, [6, 7, 8])
    assert delay is False and params is not None
    assert TransferReport.from_dict(params["tandem_transfer"]) == TransferReport(ok=True, bytes=123)


def test_blocks_past_the_prompt_are_not_pulled() -> None:
    """A prompt of exactly two blocks: the decode node also allocates room for its first output token."""
    params = {**_decode_params(_sched(), n_tokens=8), "remote_block_ids": [7, 8]}
    d = _sched()
    req = _req("d1", 8, params)
    assert d.get_num_new_matched_tokens(req, 0) == (8, True)
    d.update_state_after_alloc(req, _blocks([], [3, 4, 5]), 8)
    (recv,) = d.build_connector_meta().recvs
    assert recv.remote_block_ids == [7, 8] and recv.local_block_ids == [3, 4]


# -- layer-wise, prefill side ------------------------------------------------------------------------------
def _filling(rid: str, n_tokens: int, tid: str) -> SimpleNamespace:
    from contracts.transfer import LAYERWISE_ID_KEY

    r = _req(rid, n_tokens, {"do_remote_decode": True, LAYERWISE_ID_KEY: tid}, RequestStatus.RUNNING)
    r.num_computed_tokens, r.num_prompt_tokens = 0, n_tokens
    return r


def test_layerwise_prefill_opens_its_lease_at_allocation_and_reports_only_its_last_chunk() -> None:
    p = _sched()
    p.kv_cache_manager.get_block_ids = lambda rid: ([7, 8, 9, 11],)  # 10 tokens: 3 prompt blocks + 1 more
    r = _filling("r1", 10, "lw-1")
    p.update_state_after_alloc(r, None, 0)
    p.update_state_after_alloc(r, None, 0)  # allocated again (after a preemption): one lease still
    meta = p.build_connector_meta(scheduled={"r1": 4})  # the first chunk: nothing to report yet
    assert meta.opens == [("lw-1", "r1")] and meta.fills == [] and meta.leases == []
    r.num_computed_tokens = 4
    meta = p.build_connector_meta(scheduled={"r1": 6})  # the last chunk: its layers are reported
    assert [(f.transfer_id, f.block_ids) for f in meta.fills] == [("lw-1", [7, 8, 9])]
    r.num_computed_tokens, r.status = 10, RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.request_finished(r, [7, 8, 9])
    assert delay is True and params is not None and params["transfer_id"] == "lw-1"
    meta = p.build_connector_meta()
    assert [(e.transfer_id, e.ok) for e in meta.fill_ends] == [("lw-1", True)]
    assert meta.leases == [] and meta.fills == []  # no second lease for the same blocks
    assert p.build_connector_meta().empty()


def test_layerwise_prefill_aborted_half_way_closes_its_fill_and_keeps_its_blocks_until_the_lease_ends() -> None:
    p = _sched()
    r = _filling("r1", 10, "lw-2")
    p.update_state_after_alloc(r, None, 0)
    p.build_connector_meta(scheduled={"r1": 4})
    r.status = RequestStatus.FINISHED_ABORTED
    assert p.request_finished(r, [7, 8, 9]) == (True, None)  # a decode node may be reading them now
    meta = p.build_connector_meta()
    assert [(e.transfer_id, e.ok) for e in meta.fill_ends] == [("lw-2", False)]
    assert "aborted" in meta.fill_ends[0].reason


def test_a_reused_layerwise_id_opens_no_second_lease_and_is_leased_whole_under_its_own_id() -> None:
    p = _sched()
    first = _filling("r1", 10, "lw-same")
    p.update_state_after_alloc(first, None, 0)
    second = _filling("r2", 10, "lw-same")  # a sender reused the id (router-chosen ids never repeat)
    p.update_state_after_alloc(second, None, 0)
    assert p.build_connector_meta().opens == [("lw-same", "r1")]
    second.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.request_finished(second, [4, 5, 6])
    # Its decode leg pulls its own blocks under its own id, never the first request's lease.
    assert delay is True and params is not None and params["transfer_id"] == "r2"
    assert [(lease.transfer_id, lease.block_ids) for lease in p.build_connector_meta().leases] == [("r2", [4, 5, 6])]
