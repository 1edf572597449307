"""The connector's settings: ``kv_connector_extra_config`` of ``--kv-transfer-config`` (written by the
node from its own settings, see ``kv_transfer.config``). That JSON is on the engine's command line, so
it never carries the cluster secret itself: only where to find it (``auth.py``)."""

from __future__ import annotations

import os
import socket
import tempfile
from functools import cache
from typing import Literal

from pydantic import BaseModel, ConfigDict

from contracts.secret import is_loopback, load_cluster_secret
from kv_transfer import wire
from kv_transfer.config import ONE_HOST_TRANSPORTS, TransportName


class ConnectorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    """Address decode nodes reach this node's block server at (advertised in kv_transfer_params)."""
    port: int = 14579
    """Block server's tcp port (the node uses its port + 3)."""
    bind_host: str | None = None
    """Interface to bind; None: ``host`` when it is loopback, else every interface."""
    transport: TransportName = TransportName.AUTO
    """How a decode node pulls (``TransportName``)."""
    checksum: Literal["auto", "always", "never"] = "auto"
    """xxh3-64 of every segment, verified on arrival. ``auto``: on for tcp/ipc frames, off for shm
    (a kernel copy within one host has no wire to corrupt)."""
    lease_s: float = 30.0
    """How long a prefill node holds a request's blocks for its decode node, at most."""
    transfer_timeout_s: float = 10.0
    """How long a decode node waits for one pull before giving up (a load error)."""
    split_stall_s: float = 2.0
    """A split prefill's pull (``kv_connector.layer_gate``): how long this node's forward pass waits for
    the peer's next layer before it gives the pull up and recomputes the prefix. Short, because the
    whole engine waits meanwhile: the router splits only onto an idle peer, whose first layer comes
    within one of its steps."""
    reject_when_full: bool = True
    """A decode node without free blocks for a transfer releases the prefill node's lease at once and
    prefills locally when room appears, rather than keep remote blocks pinned while it queues."""
    pull_threads: int = 4
    huge_pages: bool = True
    """Back the KV cache with transparent huge pages at start (``kv_transfer/hugepages.py``): the
    kernel copy of ``shm`` pulls pins pages one by one, and 2 MiB pages make that ~20% cheaper."""
    shm_split: bool = True
    """``shm`` pulls: the prefill node writes half of the layers into this node's cache while this
    node reads the other half, so the copy runs on both nodes' cores (a node that cannot write
    leaves its half to this one)."""
    shm_split_min_bytes: int = 8 << 20
    """Smaller ``shm`` pulls are not split: this node copies every layer itself, before the Grant
    comes when it knows the prefill process (``transports.KnownPeer``). Splitting halves the copy but
    puts the prefill node's write and its ``Pushed`` answer on the pull's path: one more message
    and a wake-up of the prefill process, which cost more than half of a copy this small saves
    (a 1-block pull of a 135M model is 2.9 MB; 8 MiB copy in ~1 ms here)."""
    cluster_secret_file: str | None = None
    """File holding the cluster secret that signs every KV control message (``auth.py``). None:
    ``$TANDEM_CLUSTER_SECRET``, else ``$TANDEM_CLUSTER_SECRET_FILE``, else the per-user default file,
    which only a node binding loopback addresses alone may use."""
    faults: bool = False
    """Let peers arm faults on this node's block server (``wire.Fault``: corrupt, stall, hold, expire)
    for tests. Off unless the node's ``kv_faults`` (``TANDEM_NODE_KV_FAULTS=1``); a server started with it
    logs a WARNING."""
    idle_wait_ms: float = 5.0
    """On a step that computes nothing but waits for transfers, sleep up to this long until one ends.
    vLLM steps such an engine in a tight loop; on a CPU node that loop takes the very core the pull
    (decode) or the send (prefill) needs. The cost: a request arriving then waits at most this long
    before its first step. 0 turns it off."""
    pull_wait_ms: float = 50.0
    """The same wait while this node pulls (a decode node whose idle step waits for its own pull): up
    to this long, and woken the moment a pull ends. Between two steps vLLM's worker spins on its
    step queue (``sched_yield`` for a second after each step; ``shm_broadcast.SpinCondition``), on
    the very core the pull thread copies on, so every return to vLLM's loop during a pull costs copy
    time: measured (1P+1D, bf16, 7.5k tokens, 174 MB over ``shm``), median pulls of 52.8 ms with
    5 ms waits against 22.5 ms with waits until the pull ends. The cost: a request arriving at this
    node during a pull waits for its first step until that pull ends, this long at most. 0: the
    pull waits ``idle_wait_ms`` like a lease."""

    @property
    def ipc_path(self) -> str:
        return os.path.join(tempfile.gettempdir(), "tandem", f"kv-data-{self.port}.sock")

    @property
    def endpoints(self) -> dict[str, str]:
        """What decode nodes connect to."""
        return {"tcp": f"tcp://{self.host}:{self.port}", "ipc": f"ipc://{self.ipc_path}"}

    @property
    def bind_endpoints(self) -> list[str]:
        host = self.bind_host or (self.host if is_loopback(self.host) else "*")
        return [f"tcp://{host}:{self.port}", f"ipc://{self.ipc_path}"]

    @property
    def binds_loopback_only(self) -> bool:
        """Every address the block server binds is a loopback one (ipc is a local file)."""
        return all(
            is_loopback(ep.removeprefix("tcp://").rsplit(":", 1)[0])
            for ep in self.bind_endpoints
            if ep.startswith("tcp://")
        )

    def codec(self) -> wire.Codec:
        """The signer of this node's KV messages; ``ConfigError`` when no usable secret is set (see
        ``auth.py``: a node binding a real interface must be given one)."""
        return wire.Codec(
            load_cluster_secret(secret_file=self.cluster_secret_file, loopback_only=self.binds_loopback_only)
        )

    def choose_transport(self, remote_host_id: str, requested: str | None = None) -> str:
        """``requested``: a per-request choice from kv_transfer_params (benchmarks), else the setting."""
        want = TransportName(requested) if requested in tuple(TransportName) else self.transport
        same_host = remote_host_id == host_id()
        if want is TransportName.AUTO:
            want = TransportName.SHM if same_host else TransportName.TCP
        elif want in ONE_HOST_TRANSPORTS and not same_host:
            want = TransportName.TCP  # a one-host transport cannot reach another host
        return want.value

    def checksum_for(self, transport: str) -> bool:
        if self.checksum == "auto":
            return transport != TransportName.SHM  # tcp, ipc and ucx cross a wire or a socket
        return self.checksum == "always"


@cache
def host_id() -> str:
    """Same value for every process of one host: decides whether one-host transports apply. A host is
    one boot of one machine *and* one network namespace: processes in two namespaces of one kernel (two
    containers, two hosts of ``tandem lab``) share the hostname and boot id, yet each is another host
    to the network, with its own addresses and, in a container, its own /tmp where the ipc sockets
    live. Without the namespace, ``auto`` chose shm between them and the KV never crossed the network
    it was meant to cross (found on the lab, issue 38)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = ""
    return f"{socket.gethostname()}/{boot}/{netns}"
