"""Who may talk to a block server over ipc: the local credentials that prove a peer is a process of this
host (the ``shm`` transport). The cluster secret behind every message's MAC is ``contracts.secret``.

A ZeroMQ ``ipc://`` connection is a Unix-domain socket; libzmq reads the peer's ``SO_PEERCRED`` (uid, gid,
pid, as the kernel saw them at connect) and hands it over as each frame's ``Peer-Address`` property:
``"<host>:<uid>:<gid>:<pid>"``. A frame from ``tcp://`` carries an IP address instead, so it has no
credentials: ``peer_credentials`` returns None and nothing that needs a local peer is granted over tcp.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class PeerCredentials:
    """The connecting process of a Unix-domain socket, as the kernel reported it (SO_PEERCRED)."""

    uid: int
    gid: int
    pid: int


def peer_credentials(frame: zmq.Frame) -> PeerCredentials | None:
    """Credentials of the process at the other end of the Unix-domain socket ``frame`` came in on;
    None for a frame from tcp, or when libzmq was built without SO_PEERCRED: such a peer is not
    proven local. A tcp frame's Peer-Address is a numeric IP address, never ``localhost``, so an
    IPv6 address (``fe80::1:2:3``) cannot pass for credentials; the block server also keeps its ipc
    endpoint on a socket of its own and never asks a tcp frame."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    parts = str(address).rsplit(":", 3)
    if len(parts) != 4 or parts[0] != "localhost" or not all(p.isdigit() for p in parts[1:]):
        return None
    return PeerCredentials(int(parts[1]), int(parts[2]), int(parts[3]))
