"""A peer prefix fetch (``TransferParams.prefix_tokens``, ``router.planning.peer_fetch``): the node reports only the
prefix's whole blocks past its own hit as loadable, pulls exactly those blocks by position into its own,
and leaves the rest of the prompt to compute; a prefix it already holds releases the peer's lease."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

from contracts.transfer import TransferParams, block_key
from kv_connector.scheduler import TandemScheduler
from kv_transfer.settings import ConnectorSettings

BS = 4


def _hashes(prompt: int) -> list[bytes]:
    return [hashlib.sha256(f"block {i}".encode()).digest() for i in range(prompt // BS)]


def _request(prompt: int, prefix: int | None, peer_blocks: list[int], key_block: int | None = None) -> SimpleNamespace:
    """``key_block``: whose hash the router's key is (default the prefix's last block: the same prompt)."""
    hashes = _hashes(prompt)
    key = None
    if prefix is not None:
        last = min(prefix, prompt - 1) // BS - 1
        key = block_key(hashes[last if key_block is None else key_block])
    params = TransferParams(
        transfer_id="t1",
        remote_block_ids=peer_blocks,
        remote_endpoints={"tcp": "tcp://127.0.0.1:9"},
        remote_host_id="h",
        remote_engine_id="e",
        remote_num_tokens=len(peer_blocks) * BS,
        lease_deadline=1e10,
        prefix_tokens=prefix,
        prefix_key=key,
    ).to_dict()
    return SimpleNamespace(
        request_id="r1", prompt_token_ids=list(range(prompt)), kv_transfer_params=params, block_hashes=hashes
    )


def _blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def test_only_the_prefix_past_the_local_hit_is_pulled() -> None:
    sched = TandemScheduler(ConnectorSettings(port=9103), "engine-x", block_size=BS)
    req = _request(prompt=22, prefix=16, peer_blocks=[70, 71, 72, 73])
    # the node holds its first block itself: blocks 1..3 of the prefix (12 tokens) come from the peer
    assert sched.get_num_new_matched_tokens(req, BS) == (12, True)
    sched.update_state_after_alloc(req, _blocks([10, 11, 12, 13]), 12)
    [recv] = sched.build_connector_meta().recvs
    assert recv.remote_block_ids == [71, 72, 73] and recv.local_block_ids == [11, 12, 13]
    assert req.kv_transfer_params["do_remote_prefill"] is False  # one transfer


def test_a_prefix_never_reaches_the_prompts_last_token() -> None:
    sched = TandemScheduler(ConnectorSettings(port=9103), "engine-x", block_size=BS)
    req = _request(prompt=16, prefix=16, peer_blocks=[70, 71, 72, 73])
    # 16 tokens: the last is computed here, so only the 3 whole blocks before it are loaded
    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)
    sched.update_state_after_alloc(req, _blocks([10, 11, 12]), 12)
    [recv] = sched.build_connector_meta().recvs
    assert recv.remote_block_ids == [70, 71, 72] and recv.local_block_ids == [10, 11, 12]


def test_a_prefix_held_locally_releases_the_peers_lease() -> None:
    sched = TandemScheduler(ConnectorSettings(port=9103), "engine-x", block_size=BS)
    req = _request(prompt=22, prefix=8, peer_blocks=[70, 71])
    assert sched.get_num_new_matched_tokens(req, 12) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # released at once: the host tier may load
    sched.update_state_after_alloc(req, _blocks([10, 11, 12]), 0)
    meta = sched.build_connector_meta()
    assert not meta.recvs and [r.transfer_id for r in meta.releases] == ["t1"]  # once


def test_a_prefix_of_other_tokens_is_computed_never_loaded() -> None:
    """The router's key names another chain (the prompt tokenized otherwise than the peer's leg, or
    another salt): nothing is pulled, the lease is released, the prompt computed here."""
    sched = TandemScheduler(ConnectorSettings(port=9103), "engine-x", block_size=BS)
    req = _request(prompt=22, prefix=16, peer_blocks=[70, 71, 72, 73], key_block=2)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = sched.build_connector_meta()
    assert not meta.recvs and [r.transfer_id for r in meta.releases] == ["t1"]
    no_key = _request(prompt=22, prefix=16, peer_blocks=[70, 71, 72, 73])
    no_key.kv_transfer_params.pop("prefix_key")
    assert sched.get_num_new_matched_tokens(no_key, 0) == (0, False)  # unverifiable: computed


def test_without_prefix_tokens_the_whole_prompt_is_pulled_as_before() -> None:
    sched = TandemScheduler(ConnectorSettings(port=9103), "engine-x", block_size=BS)
    req = _request(prompt=10, prefix=None, peer_blocks=[70, 71, 72])
    assert sched.get_num_new_matched_tokens(req, 0) == (10, True)
    assert "prefix_tokens" not in req.kv_transfer_params  # unset stays off the wire
