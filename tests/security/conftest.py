"""Security tests: the KV tests' cluster secret (``TANDEM_CLUSTER_SECRET`` for the whole session)."""

from tests.kv_transfer.conftest import cluster_secret  # noqa: F401 - the session fixture, used here too
