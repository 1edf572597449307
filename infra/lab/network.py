"""A lab of namespaced hosts on one machine: real network stacks, real addresses, links that can be cut.

Every host is a Linux network namespace with its own loopback and one interface, ``eth0``, whose peer sits
in the machine's namespace on the bridge of the host's region. Each region is one bridge (one L2 segment,
one /24); two regions are joined by one veth pair between their bridges, the inter-region link. Nothing
gets an address outside the namespaces the lab made: the bridges and host-side peers carry none, so no
process outside the lab can reach a lab address, and the lab reaches nothing of the machine's.

    region 0: bridge tl<lab>b0, 10.<net>.0.0/24          region 1: bridge tl<lab>b1, 10.<net>.1.0/24
       host a  10.<net>.0.10 ─┐                              ┌─ host c  10.<net>.1.10
       host b  10.<net>.0.11 ─┴─ bridge ══ inter-region ══ bridge ─┘
                                            link

A cut is a link set down, the way a real partition looks to TCP (packets vanish, nothing is refused):
``cut(host)`` takes one host off its region, ``cut_regions()`` separates the regions; ``heal`` undoes
either. ``tc netem`` is not available on the lab hosts we run on (no kernel module), so there is no delay
or loss injection here, only partitions.

Names are short on purpose: Linux interface names have at most 15 characters, so a lab's name is at most
4 characters and a host's interfaces are named by index. ``Lab.down`` removes everything the lab made,
also what a killed earlier run of the same name left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import re
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from contracts.errors import ConfigError

_CLONE_NEWNET = 0x40000000
_LIBC = ctypes.CDLL(None, use_errno=True)
_NAME = re.compile(r"[a-z][a-z0-9]{0,3}")
_HOST = re.compile(r"[a-z][a-z0-9-]{0,19}")


@dataclass(frozen=True)
class Host:
    name: str
    region: int
    index: int
    address: str
    namespace: str
    outer: str
    """The host-side peer of its ``eth0``, on the region's bridge (what ``cut`` sets down)."""


@dataclass(frozen=True)
class LabSpec:
    name: str
    hosts: dict[str, int]
    """Host name -> region (0 or 1), in the order the hosts are made."""
    net: int = 231
    """The second octet of every lab address: 10.<net>.<region>.<10 + host index>."""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ConfigError(f"lab name {self.name!r}: 1-4 characters of [a-z0-9], starting with a letter")
        if not self.hosts or len(self.hosts) > 200:
            raise ConfigError("a lab has 1 to 200 hosts")
        for host, region in self.hosts.items():
            if not _HOST.fullmatch(host):
                raise ConfigError(f"host name {host!r}: 1-20 characters of [a-z0-9-], starting with a letter")
            if region not in (0, 1):
                raise ConfigError(f"host {host!r}: region must be 0 or 1, not {region}")
        if not 0 <= self.net <= 255:
            raise ConfigError("net must be a byte")


def _setns(fd: int) -> None:
    if _LIBC.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise ConfigError(f"lab: setns failed: {os.strerror(err)}")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ConfigError(f"lab: `{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


@dataclass
class Lab:
    """The namespaces, bridges and links of one ``LabSpec`` (see the module docstring)."""

    spec: LabSpec
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        per_region = {0: 0, 1: 0}
        for i, (name, region) in enumerate(self.spec.hosts.items()):
            address = f"10.{self.spec.net}.{region}.{10 + per_region[region]}"
            per_region[region] += 1
            self.hosts[name] = Host(name, region, i, address, f"tl-{self.spec.name}-{name}", f"tl{self.spec.name}h{i}")

    @property
    def regions(self) -> list[int]:
        return sorted({h.region for h in self.hosts.values()})

    def bridge(self, region: int) -> str:
        return f"tl{self.spec.name}b{region}"

    def subnet(self, region: int) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.{self.spec.net}.{region}.0/24")

    # -- lifecycle -------------------------------------------------------------------------------------
    def up(self) -> Lab:
        self.down()  # what a killed run of this name left
        try:
            for region in self.regions:
                _run("ip", "link", "add", self.bridge(region), "type", "bridge")
                _run("ip", "link", "set", self.bridge(region), "up")
            if len(self.regions) == 2:
                a, b = f"tl{self.spec.name}w0", f"tl{self.spec.name}w1"
                _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
                _run("ip", "link", "set", a, "master", self.bridge(0), "up")
                _run("ip", "link", "set", b, "master", self.bridge(1), "up")
            for host in self.hosts.values():
                self._make_host(host)
        except BaseException:
            self.down()
            raise
        return self

    def _make_host(self, host: Host) -> None:
        ns = host.namespace
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", host.outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", host.outer, "master", self.bridge(host.region), "up")
        prefix = 16 if len(self.regions) == 2 else 24  # two regions: one routed-free /16 across the link
        _run("ip", "-n", ns, "addr", "add", f"{host.address}/{prefix}", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def down(self) -> None:
        """Remove every namespace, bridge and link of this lab's name, made now or by an earlier run."""
        prefix = f"tl-{self.spec.name}-"
        for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
            ns = line.split()[0] if line.split() else ""
            if ns.startswith(prefix):
                for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                _run("ip", "netns", "del", ns, check=False)
        links = _run("ip", "-o", "link", "show", check=False).stdout
        for name in re.findall(rf"^\d+: (tl{self.spec.name}[bhw]\d+)[@:]", links, flags=re.M):
            _run("ip", "link", "del", name, check=False)

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- running things --------------------------------------------------------------------------------
    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *argv]

    def popen(self, host: str, argv: Sequence[str], **kw: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command(host, argv), **kw)  # type: ignore[call-overload]

    def run(self, host: str, argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout)

    def address(self, host: str) -> str:
        return self.hosts[host].address

    @contextlib.contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """The calling thread in ``host``'s network namespace for the body of the ``with``: every socket it
        opens meanwhile (an HTTP client's connections; a ZeroMQ context's I/O threads, started by its
        first socket, and any thread started here) belongs to that host, as if the code ran there. A
        test then talks to the lab from a lab host without a process per request. ``setns(2)`` moves
        this one thread only, and its own namespace comes back after the body, whatever happens;
        sockets opened inside stay the host's (close them inside)."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/run/netns/{self.hosts[host].namespace}", os.O_RDONLY)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(home)

    # -- faults ----------------------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        """Take ``host`` off its region: its packets vanish both ways, as in a real partition."""
        _run("ip", "link", "set", self.hosts[host].outer, "down")

    def heal(self, host: str) -> None:
        _run("ip", "link", "set", self.hosts[host].outer, "up")

    def cut_regions(self) -> None:
        self._region_link("down")

    def heal_regions(self) -> None:
        self._region_link("up")

    def _region_link(self, state: str) -> None:
        if len(self.regions) != 2:
            raise ConfigError("this lab has one region: there is no inter-region link to cut")
        _run("ip", "link", "set", f"tl{self.spec.name}w0", state)

    @contextlib.contextmanager
    def partitioned(self, host: str) -> Iterator[None]:
        """``host`` cut for the body of the ``with``, healed after it whatever happens."""
        self.cut(host)
        try:
            yield
        finally:
            self.heal(host)
