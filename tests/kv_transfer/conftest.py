"""Every KV test process signs with the same test cluster secret: the child block servers get it as an
argument, and ``kv_transfer.control`` (which reads it from the environment, as the router does) from
``TANDEM_CLUSTER_SECRET``, set here for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from contracts.secret import SECRET_ENV
from kv_transfer import control
from tests.support.block_server_proc import SECRET


@pytest.fixture(scope="session", autouse=True)
def cluster_secret() -> Iterator[bytes]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECRET_ENV, SECRET.decode())
        control._codec.cache_clear()
        yield SECRET
    control._codec.cache_clear()
