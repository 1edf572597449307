"""Node registry in Redis: which engines exist, what they serve, and how loaded they are.

Control path only. A node writes two keys, both with a short TTL that its heartbeat refreshes:

    tandem:node:<id>   NodeInfo  (static: role, model, addresses, capacity)
    tandem:load:<id>   NodeLoad  (dynamic: running / waiting requests, KV usage)

and adds its id to the set ``tandem:nodes``. A node whose heartbeat lapses simply expires; readers
prune ids whose keys are gone, so a crashed node leaves routing within one TTL. A clean shutdown
deletes the keys at once. Values are msgpack-encoded ``msgspec`` structs carrying a schema version.

Incarnations. A node id outlives its engines: the node agent restarts a dead or hung engine, and
``tandem up`` restarts a dead agent, both under the same id. Every engine start takes a new *epoch*
from a counter that survives both (``INCR tandem:epoch:<id>``, never expiring), and registers with
it, so a reader that sees the epoch of an id change knows that everything the old engine held (KV
blocks, leases, in-flight requests) is gone, even if it never saw the id leave the registry.

Beside the routing keys, each agent keeps a status record for operators (``tandem cluster status``):

    tandem:nodestatus:<id>   NodeStatus (serving / restarting / unhealthy, epoch, restarts, last exit)

with a long TTL, so a node that gave up stays visible after its agent exited, and a short one once it is
stopped on purpose, so an ended cluster leaves the view by itself; routers never read it.

Schema history: v1 the first; v2 adds ``NodeInfo.epoch`` (default 0, so v1 entries still decode and
v1 readers ignore the field); v3 adds ``NodeInfo.kv_endpoints`` and ``kv_host_id``, the block server of a
node with our connector, which a router names in a layer-wise decode leg before the prefill node has
answered (empty in a v2 entry: that node's pairs go sequentially), and ``host_tier_events_endpoint`` /
``host_tier_replay_endpoint`` (default None: no host tier).

Proof. The keys of one cluster are its own (``contracts.cluster``), but any client of the Redis can write
under any cluster's prefix. So each entry carries ``proof``, an HMAC keyed by the cluster secret bound to
the cluster name (``registry_proof_key``); a router leaves out an entry that does not verify, and a node
with another cluster's secret (a different default secret per cluster name on loopback) is refused.

Readers check each entry (``NodeRegistry.live_nodes``): an entry of a newer schema than the reader's
(``VersionMismatch``, naming both) or one that does not decode is skipped, counted in
``NodeRegistry.skipped`` and logged once per node and reason; every other node is still listed, so one
bad entry never blinds a router to the fleet. Upgrade readers (routers) before writers (node agents).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar, cast

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from contracts.cluster import DEFAULT_CLUSTER, key
from contracts.errors import StoreError, VersionMismatch

log = logging.getLogger("tandem.registry")

REGISTRY_SCHEMA_VERSION = 3
NODES_SET = "tandem:nodes"
"""The default cluster's node set (``nodes_set`` names any cluster's)."""
STATUS_TTL_S = 3600.0
"""How long a node's status record outlives its last update (an unhealthy node stays visible)."""
STOPPED_TTL_S = 60.0
"""How long the record of a node stopped on purpose stays: long enough to see it stop, short enough that an
ended cluster leaves ``tandem cluster status`` by itself."""


_LIVE_NODES_LUA = """
local ids = redis.call('SMEMBERS', KEYS[1])
local out = {}
for _, id in ipairs(ids) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('GET', ARGV[1] .. id) or false
  out[#out + 1] = redis.call('GET', ARGV[2] .. id) or false
end
return out
"""
"""The whole fleet in one round trip: each id of the set with its info and load entries (false where
gone). Every router reads it every ``registry_refresh_s``; as SMEMBERS then MGET it was two round
trips, most of an idle router's CPU (redis-py's client costs more per command than the command)."""


def nodes_set(cluster: str = DEFAULT_CLUSTER) -> str:
    """The set of a cluster's registered node ids (``tandem:nodes`` for ``default``)."""
    return key(cluster, "nodes")


def node_key(node_id: str, cluster: str = DEFAULT_CLUSTER) -> str:
    return key(cluster, "node", node_id)


def load_key(node_id: str, cluster: str = DEFAULT_CLUSTER) -> str:
    return key(cluster, "load", node_id)


def epoch_key(node_id: str, cluster: str = DEFAULT_CLUSTER) -> str:
    return key(cluster, "epoch", node_id)


def status_key(node_id: str, cluster: str = DEFAULT_CLUSTER) -> str:
    return key(cluster, "nodestatus", node_id)


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # colocated: prefills and decodes its own requests, no KV transfer


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a node is. Written at registration; unchanged for the node's life."""

    node_id: str
    role: Role
    model: str
    """Served model name (what clients put in ``model``)."""
    url: str
    """Base URL of the engine's OpenAI-compatible HTTP server, e.g. http://127.0.0.1:8100."""
    block_size: int
    max_model_len: int
    kv_connector: str
    """Connector in use (``nixl``, ``tandem`` or ``none``)."""
    kv_events_endpoint: str | None = None
    """ZeroMQ PUB endpoint of the engine's KV events."""
    kv_replay_endpoint: str | None = None
    """ZeroMQ ROUTER endpoint that replays KV events from a sequence number."""
    kv_events_auth: str = "none"
    """``curve``: both endpoints are the node's CURVE relay (``node_agent.kv_events_relay``), reached
    with keys derived from the cluster secret; ``none``: the engine's own (loopback) sockets. A reader
    that predates the field connects without CURVE and gets no events: fewer hits, nothing wrong."""
    host_tier_events_endpoint: str | None = None
    """The events of the host tier (``tandem tier serve``) this node's engine offloads to and loads from;
    nodes of one host that name the same endpoint share that tier. None: no host tier."""
    host_tier_replay_endpoint: str | None = None
    """Where the tier answers a subscriber catching up with a snapshot of its blocks."""
    model_path: str | None = None
    """Local model folder, so a router on the same host can load the exact tokenizer and template."""
    num_kv_blocks: int = 0
    """KV cache capacity in blocks (0 until the engine reports it)."""
    started_at: float = 0.0
    epoch: int = 0
    """Incarnation of the engine behind this id (see the module docstring); 0 for a v1 entry."""
    kv_endpoints: dict[str, str] = msgspec.field(default_factory=dict)
    """The node's KV block server (``kv_connector == "tandem"``, prefill or decode role): ``{"tcp":
    "tcp://host:port", "ipc": "ipc://path"}``, exactly what its own kv_transfer_params would name. A
    router sends a layer-wise decode leg there before the prefill leg has answered. Empty: none (another
    connector, a colocated node, or an entry older than v3)."""
    kv_host_id: str = ""
    """The node's host (``kv_transfer.settings.host_id``): a decode node on the same one may pull over
    ``shm``. Empty with ``kv_endpoints``."""
    proof: str = ""
    """HMAC proving that the node holds its cluster's secret (``registration_proof``): a reader given a
    proof key leaves out an entry without a valid one. Readers that predate it ignore it (msgspec drops
    unknown fields), so it needs no new schema version."""
    schema_version: int = REGISTRY_SCHEMA_VERSION


class NodeLoad(msgspec.Struct, frozen=True, kw_only=True):
    """How busy a node is, as its agent last read it from the engine's metrics."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """Fraction of KV blocks in use, 0..1."""
    updated_at: float = 0.0
    failed_probes: int = 0
    """Probes of the engine in a row that failed (0: the last one answered). The agent keeps such a
    node registered, with the last load it read, until it counts as hung; routers leave it out of
    routing meanwhile (while another node serves the model) but keep what it holds in the fleet index,
    so one slow probe of a busy engine costs no cache, and a stopped engine gets no new requests."""


class NodeState(enum.StrEnum):
    STARTING = "starting"
    SERVING = "serving"
    RESTARTING = "restarting"
    """The engine died or hung; the agent waits out its backoff and starts a new one."""
    UNHEALTHY = "unhealthy"
    """Too many failures in the window: the agent gave up (and exited non-zero)."""
    STOPPED = "stopped"


_T = TypeVar("_T")


class NodeStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What an operator wants to know about a node agent; not read on any serving path."""

    node_id: str
    state: NodeState
    epoch: int = 0
    restarts: int = 0
    """Engine restarts since the agent started."""
    last_exit: str | None = None
    """Why the last engine ended (exit status, signal, or "hung: ..."), if one did."""
    updated_at: float = 0.0


def registry_proof_key(secret: bytes, cluster: str) -> bytes:
    """The key a cluster's nodes prove their registration with: the cluster secret bound to the
    cluster's name, so a node holding another cluster's secret proves nothing here."""
    return hmac.new(secret, b"tandem registry v1:" + cluster.encode(), hashlib.sha256).digest()


def registration_proof(info: NodeInfo, key: bytes) -> str:
    """HMAC of what a router trusts a registration for: the id, incarnation and every address it would
    send a request or KV block to."""
    covered = _proof_encoder.encode(
        [
            info.node_id,
            info.epoch,
            info.role.value,
            info.url,
            sorted(info.kv_endpoints.items()),
            info.kv_events_endpoint,
            info.kv_replay_endpoint,
        ]
    )
    return hmac.new(key, covered, hashlib.sha256).hexdigest()


_proof_encoder = msgspec.json.Encoder()


_local_secret: Callable[[], bytes] | None = None


def set_local_secret(load: Callable[[], bytes]) -> None:
    """Name how this process reads its loopback cluster secret (``contracts.secret`` does, on import):
    contracts import nothing of the project, so a writer given no proof key signs through this."""
    global _local_secret
    _local_secret = load


def _local_proof_key(cluster: str) -> bytes | None:
    """The proof key of a writer given none: this process's loopback secret, if it can read one. Read at
    every write, not cached: the secret a process holds may change (a test session's fixture sets one),
    and a proof made with a stale one makes every router leave the node out."""
    return None if _local_secret is None else registry_proof_key(_local_secret(), cluster)


class LiveNode(msgspec.Struct, frozen=True, kw_only=True):
    info: NodeInfo
    load: NodeLoad


class _Versioned(msgspec.Struct):
    """Only an entry's version, read before the rest (a newer schema may not decode as ours)."""

    schema_version: int = 1


_version_decoder = msgspec.msgpack.Decoder(_Versioned)
_info_decoder = msgspec.msgpack.Decoder(NodeInfo)
_load_decoder = msgspec.msgpack.Decoder(NodeLoad)
_status_decoder = msgspec.msgpack.Decoder(NodeStatus)
_encoder = msgspec.msgpack.Encoder()


class NodeRegistry:
    """Async access to the registry; one per process, sharing the process's Redis client."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        ttl_s: float = 15.0,
        cluster: str = DEFAULT_CLUSTER,
        proof_key: bytes | None = None,
    ) -> None:
        self._redis = redis
        self._proof_key = proof_key
        """``registry_proof_key`` of the cluster: a reader leaves out an entry whose proof does not verify
        (reason ``unproven``), a writer signs its entry with it. None: a reader checks nothing, a writer
        signs with this process's loopback secret (``_local_proof_key``)."""
        self.cluster = cluster
        """Every key this registry reads or writes is under this cluster's prefix (``contracts.cluster``):
        a router sees only its own cluster's nodes."""
        self._set = nodes_set(cluster)
        self.ttl_ms = int(ttl_s * 1000)
        self.skipped: Counter[str] = Counter()
        """Entries left out of ``live_nodes`` / ``statuses`` since start, by reason (``version``,
        ``malformed``): each read counts each bad entry again."""
        self._warned: set[tuple[str, str]] = set()
        self._live_nodes = redis.register_script(_LIVE_NODES_LUA)
        self._checked: dict[str, tuple[bytes, NodeInfo]] = {}
        """node id -> its registration's bytes as last read and what they decoded and proved to. A
        registration changes only with a new engine (its heartbeats rewrite the load entry), so a reader
        decodes and verifies each once, not at every read: the proof's HMAC was a tenth of an idle
        router's CPU. Holds the ids of the last read only."""

    def _skip(self, node_id: str, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        if (node_id, reason) not in self._warned:  # once per node and reason: reads repeat every second
            self._warned.add((node_id, reason))
            log.warning("registry entry of node %s skipped: %s", node_id, detail)

    def _decode(self, node_id: str, raw: bytes, decoder: msgspec.msgpack.Decoder[_T]) -> _T | None:
        """One entry, or None when it is skipped (another schema version, or malformed)."""
        try:
            version = _version_decoder.decode(raw).schema_version
            if version > REGISTRY_SCHEMA_VERSION:
                raise VersionMismatch("registry schema", theirs=version, ours=REGISTRY_SCHEMA_VERSION)
            return decoder.decode(raw)
        except VersionMismatch as exc:
            self._skip(node_id, "version", exc.message)
        except msgspec.DecodeError as exc:
            self._skip(node_id, "malformed", f"undecodable: {exc}")
        return None

    async def register(self, info: NodeInfo, load: NodeLoad | None = None) -> None:
        await self.heartbeat(info, load or NodeLoad(updated_at=time.time()))

    async def heartbeat(self, info: NodeInfo, load: NodeLoad) -> None:
        """(Re)write both keys with a fresh TTL; registering and heart-beating are the same write,
        so a node that was dropped after a Redis restart or a long pause comes back by itself."""
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                if (key_ := self._proof_key or _local_proof_key(self.cluster)) is not None:
                    info = msgspec.structs.replace(info, proof=registration_proof(info, key_))
                pipe.set(node_key(info.node_id, self.cluster), _encoder.encode(info), px=self.ttl_ms)
                pipe.set(load_key(info.node_id, self.cluster), _encoder.encode(load), px=self.ttl_ms)
                pipe.sadd(self._set, info.node_id)
                await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"registry write for node {info.node_id} failed: {exc}") from exc

    async def deregister(self, node_id: str) -> None:
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(node_key(node_id, self.cluster), load_key(node_id, self.cluster))
                pipe.srem(self._set, node_id)
                await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"registry delete for node {node_id} failed: {exc}") from exc

    async def next_epoch(self, node_id: str) -> int:
        """A new incarnation number for ``node_id``: 1, 2, ... across agent and engine restarts."""
        try:
            return int(await self._redis.incr(epoch_key(node_id, self.cluster)))
        except RedisError as exc:
            raise StoreError(f"epoch counter for node {node_id} unavailable: {exc}") from exc

    async def set_status(self, status: NodeStatus) -> None:
        try:
            ttl = STOPPED_TTL_S if status.state is NodeState.STOPPED else STATUS_TTL_S
            await self._redis.set(status_key(status.node_id, self.cluster), _encoder.encode(status), px=int(ttl * 1000))
        except RedisError as exc:
            raise StoreError(f"status write for node {status.node_id} failed: {exc}") from exc

    async def statuses(self) -> list[NodeStatus]:
        """Every node status record (live, restarting, or gave up within STATUS_TTL_S), by node id."""
        try:
            keys = [k async for k in self._redis.scan_iter(match=status_key("*", self.cluster), count=500)]
            raw = cast("list[bytes | None]", await self._redis.mget(keys) if keys else [])
        except RedisError as exc:
            raise StoreError(f"node status read failed: {exc}") from exc
        found = [
            st
            for k, r in zip(keys, raw, strict=True)
            if r is not None
            and (st := self._decode(_id_of(k, status_key("", self.cluster)), r, _status_decoder)) is not None
        ]
        return sorted(found, key=lambda st: st.node_id)

    def _proven(self, info: NodeInfo) -> bool:
        if self._proof_key is None:
            return True
        return hmac.compare_digest(info.proof, registration_proof(info, self._proof_key))

    def _checked_info(self, node_id: str, raw: bytes) -> NodeInfo | None:
        """A registration decoded and its proof verified (then blanked), or None when it is skipped."""
        info = self._decode(node_id, raw, _info_decoder)
        if info is None:
            return None
        if not self._proven(info):
            self._skip(node_id, "unproven", "its registration does not prove this cluster's secret")
            return None
        return msgspec.structs.replace(info, proof="") if info.proof else info  # what a node wrote, as written

    async def live_nodes(self) -> list[LiveNode]:
        """Every node whose heartbeat has not lapsed; prunes lapsed ids from the set."""
        try:
            flat = cast(
                "list[bytes | None]",
                await self._live_nodes(keys=[self._set], args=[node_key("", self.cluster), load_key("", self.cluster)]),
            )
        except RedisError as exc:
            raise StoreError(f"registry read failed: {exc}") from exc
        entries = sorted(
            ((cast(bytes, flat[i]).decode(), flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)),
            key=lambda e: e[0],
        )
        live: list[LiveNode] = []
        lapsed: list[str] = []
        checked, self._checked = self._checked, {}
        for node_id, info_raw, load_raw in entries:
            if info_raw is None:
                lapsed.append(node_id)
                continue
            known = checked.get(node_id)
            info = known[1] if known is not None and known[0] == info_raw else self._checked_info(node_id, info_raw)
            load = self._decode(node_id, load_raw, _load_decoder) if load_raw is not None else NodeLoad()
            if info is None:
                continue
            self._checked[node_id] = (info_raw, info)
            if load is not None:
                live.append(LiveNode(info=info, load=load))
        if lapsed:
            try:
                await self._redis.srem(self._set, *lapsed)
            except RedisError:
                pass  # pruning is housekeeping; the next reader retries it
        return live


def _id_of(raw: bytes | str, key_prefix: str) -> str:
    text = raw.decode() if isinstance(raw, bytes) else raw
    return text.removeprefix(key_prefix)
