"""A decode node given kv_transfer_params of another version refuses them with an error naming both
versions and prefills the prompt itself: it pulls nothing and releases nothing (it cannot trust their
endpoints); the router likewise sends nothing for them."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from contracts.transfer import PARAMS_VERSION, TransferParams
from kv_connector.scheduler import TandemScheduler
from kv_transfer import control
from kv_transfer.settings import ConnectorSettings


def _params(version: int) -> dict:
    params = TransferParams(
        transfer_id="t1",
        remote_block_ids=[1, 2, 3],
        remote_endpoints={"tcp": "tcp://127.0.0.1:9"},
        remote_host_id="h",
        remote_engine_id="e",
        remote_num_tokens=10,
        lease_deadline=1e10,
    ).to_dict()
    return {**params, "tandem": version}


def test_params_of_another_version_are_refused_and_the_prompt_prefilled_here(caplog: pytest.LogCaptureFixture) -> None:
    sched = TandemScheduler(ConnectorSettings(port=9103), "engine-d", block_size=4)
    req = SimpleNamespace(
        request_id="r1", prompt_token_ids=list(range(10)), kv_transfer_params=_params(2), num_computed_tokens=0
    )
    with caplog.at_level(logging.ERROR, logger="tandem.kv.admission"):
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # refused once, then an ordinary request
    assert sched.admission.refused_params == 1
    [line] = [r.getMessage() for r in caplog.records]
    assert f"kv_transfer_params version 2 is not ours ({PARAMS_VERSION})" in line and "prefilling here" in line
    meta = sched.build_connector_meta()
    assert meta.empty()  # nothing pulled, nothing released


def test_the_router_sends_nothing_for_params_of_another_version(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="tandem.kv.control"):
        assert asyncio.run(control.release_lease(_params(2), "client gone")) is False
        assert asyncio.run(control.lease_report(_params(2))) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"{what} of transfer t1 not sent: kv_transfer_params version 2 is not ours ({PARAMS_VERSION}): the two "
        "sides run different Tandem releases; upgrade them together"
        for what in ("release", "lease report query")
    ]
