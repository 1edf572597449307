"""Is a node's port free, and if not, who holds it.

A node checks every TCP port its engine will bind before starting it: a leftover engine still
listening on the node's HTTP port would otherwise answer the node's health checks, the node would
report READY for an engine that is not its own, and its own engine would then die with "Address
already in use" (issue 12). The check binds each port the way uvicorn and ZeroMQ will (SO_REUSEADDR,
so a socket in TIME_WAIT does not count as taken) and, when that fails, names the process listening
there (psutil; a process of another user shows without a name).

There is still a window between this check and the engine's own bind; the check exists to turn the
common case (a leftover process) into a clear message at once, not to reserve the port.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from dataclasses import dataclass

import psutil

from contracts.errors import PortInUse


@dataclass(frozen=True, slots=True)
class PortHolder:
    pid: int | None
    name: str | None
    cmdline: str | None

    def describe(self) -> str:
        if self.pid is None:
            return "a process this user cannot see (another user's, or in another network namespace)"
        what = self.cmdline or self.name or "?"
        return f"pid {self.pid} ({self.name or '?'}: {what[:160]})"


def port_free(host: str, port: int) -> bool:
    """True when ``host:port`` can be bound for listening now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def port_holder(port: int) -> PortHolder:
    """The process listening on TCP ``port`` (any address), as far as this user can see."""
    pid: int | None = None
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                pid = conn.pid
                if pid is not None:
                    break
    if pid is None:
        return PortHolder(None, None, None)
    try:
        proc = psutil.Process(pid)
        return PortHolder(pid, proc.name(), " ".join(proc.cmdline()))
    except psutil.Error:
        return PortHolder(pid, None, None)


def check_ports_free(host: str, ports: dict[int, str]) -> None:
    """Raise ``PortInUse`` for the first of ``ports`` (port -> what it is for) that is taken."""
    for port, purpose in sorted(ports.items()):
        if not port_free(host, port):
            holder = port_holder(port)
            raise PortInUse(
                f"port {port} ({purpose}) on {host} is already in use by {holder.describe()}; "
                f"stop that process or give this node another --port",
                port=port,
                holder_pid=holder.pid,
            )
