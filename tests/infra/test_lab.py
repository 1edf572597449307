"""``tandem lab``: namespaced hosts with real network stacks, two regions, links that are cut and healed.
Real Redis servers run inside the lab's hosts and a real client in another host reaches them (or not):
what a partition does to TCP is what the test sees, not a mock of it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis

from contracts.errors import ConfigError
from infra.lab import Lab, LabSpec
from kv_transfer.settings import ConnectorSettings, host_id
from tests.support.helpers import wait_for

PORT = 6390
SPEC = LabSpec("tst", {"client": 0, "server": 0, "far": 1})


def _ping(lab: Lab, host: str, target: str) -> bool:
    """A Redis PING from inside ``host`` to the lab's ``target`` host, with 1 s timeouts."""
    code = (
        "import redis, sys; "
        f"r = redis.Redis(host={lab.address(target)!r}, port={PORT}, socket_timeout=1, socket_connect_timeout=1); "
        "sys.exit(0 if r.ping() else 1)"
    )
    return lab.run(host, [sys.executable, "-c", code], timeout=30).returncode == 0


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(SPEC) as lab:
        servers = [
            lab.popen(
                host,
                # Protected mode refuses password-less clients from other hosts; these addresses exist only in the lab.
                [
                    "redis-server",
                    "--bind",
                    lab.address(host),
                    "--port",
                    str(PORT),
                    "--save",
                    "",
                    "--protected-mode",
                    "no",
                ],
                stdout=subprocess.DEVNULL,
            )
            for host in ("server", "far")
        ]
        try:
            assert wait_for(lambda: _ping(lab, "server", "server") and _ping(lab, "far", "far"), 30)
            yield lab
        finally:
            for p in servers:
                p.kill()
                p.wait()


def test_hosts_reach_each_other_across_both_regions(lab: Lab) -> None:
    assert lab.address("client").startswith("10.231.0.") and lab.address("far").startswith("10.231.1.")
    assert _ping(lab, "client", "server") and _ping(lab, "client", "far")


def test_a_cut_host_is_unreachable_until_healed_and_the_others_keep_talking(lab: Lab) -> None:
    with lab.partitioned("server"):
        assert not _ping(lab, "client", "server")
        assert _ping(lab, "client", "far")
    assert _ping(lab, "client", "server")


def test_cutting_the_inter_region_link_separates_the_regions_only(lab: Lab) -> None:
    lab.cut_regions()
    try:
        assert not _ping(lab, "client", "far")
        assert _ping(lab, "client", "server")
    finally:
        lab.heal_regions()
    assert _ping(lab, "client", "far")


def test_a_thread_inside_a_host_talks_from_that_host_and_comes_back(lab: Lab) -> None:
    """``Lab.inside``: the calling thread's sockets are the host's for the body of the ``with``."""
    home = os.stat("/proc/thread-self/ns/net").st_ino
    with lab.inside("client"):
        assert os.stat("/proc/thread-self/ns/net").st_ino != home
        client = redis.Redis(host=lab.address("server"), port=PORT, socket_timeout=1, socket_connect_timeout=1)
        assert client.ping()
        assert client.client_info()["addr"].startswith(lab.address("client") + ":")  # as the server saw us
        client.close()
    assert os.stat("/proc/thread-self/ns/net").st_ino == home
    outside = redis.Redis(host=lab.address("server"), port=PORT, socket_timeout=1, socket_connect_timeout=1)
    # From the machine's namespace the lab's address leads elsewhere (its default route), never to the lab.
    with pytest.raises(redis.RedisError):
        outside.ping()


def test_two_hosts_are_two_hosts_to_the_kv_transport(lab: Lab) -> None:
    """A lab host shares the machine's hostname and boot id, and is still another host: ``auto`` must not
    pick a one-host transport (shm, ipc) between lab hosts (``kv_transfer.settings.host_id``)."""
    code = "from kv_transfer.settings import host_id; print(host_id())"
    ids = {h: lab.run(h, [sys.executable, "-c", code], timeout=60).stdout.strip() for h in ("client", "server")}
    assert all(ids.values()) and ids["client"] != ids["server"] != host_id()
    assert ConnectorSettings().choose_transport(ids["server"]) == "tcp"


def test_the_lab_puts_no_address_on_the_machines_own_interfaces(lab: Lab) -> None:
    own = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    assert "10.231." not in own


def test_down_removes_everything_the_lab_made() -> None:
    spec = LabSpec("tsd", {"a": 0, "b": 1})
    lab = Lab(spec).up()
    assert any(line.startswith("tl-tsd-") for line in _netns())
    lab.down()
    assert not any(line.startswith("tl-tsd-") for line in _netns())
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert "tltsd" not in links


def test_names_that_do_not_fit_interface_names_are_refused() -> None:
    with pytest.raises(ConfigError, match="1-4 characters"):
        LabSpec("toolong", {"a": 0})
    with pytest.raises(ConfigError, match="region must be 0 or 1"):
        LabSpec("ok", {"a": 2})


def _netns() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.splitlines()
