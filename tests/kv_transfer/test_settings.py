"""Transport choice: one-host transports only between processes of one host; per-request overrides."""

from __future__ import annotations

from kv_transfer.settings import ConnectorSettings, host_id


def test_auto_picks_shm_on_one_host_and_tcp_across_hosts() -> None:
    s = ConnectorSettings()
    assert s.choose_transport(host_id()) == "shm"
    assert s.choose_transport("elsewhere/boot") == "tcp"


def test_one_host_transports_never_cross_hosts_and_requests_may_override() -> None:
    s = ConnectorSettings(transport="ipc")
    assert s.choose_transport(host_id()) == "ipc"
    assert s.choose_transport("elsewhere/boot") == "tcp"
    assert s.choose_transport(host_id(), "tcp") == "tcp"
    assert s.choose_transport(host_id(), "shm") == "shm"
    assert s.choose_transport(host_id(), "bogus") == "ipc"


def test_checksums_on_for_frames_off_for_kernel_copies_unless_forced() -> None:
    assert ConnectorSettings().checksum_for("tcp") and not ConnectorSettings().checksum_for("shm")
    assert ConnectorSettings(checksum="always").checksum_for("shm")
    assert not ConnectorSettings(checksum="never").checksum_for("tcp")


def test_endpoints_bind_loopback_or_every_interface() -> None:
    s = ConnectorSettings(host="127.0.0.1", port=9103)
    assert s.endpoints["tcp"] == "tcp://127.0.0.1:9103" and s.endpoints["ipc"].endswith("kv-data-9103.sock")
    assert ConnectorSettings(host="10.0.0.5", port=9103).bind_endpoints[0] == "tcp://*:9103"
