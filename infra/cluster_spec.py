"""What a ``tandem up`` cluster is made of, before anything starts: its nodes (role and served model
each), its routers, its Redis, its engine settings, its host tier (``ClusterSpec``), and the served models
of a several-model cluster (``ModelSpec``, from ``--model NAME=PATH`` or a models file, checked as the
router will check it). ``infra.launcher.Cluster`` starts what a spec describes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from contracts.errors import ConfigError
from contracts.models_file import check_models, read_models_file
from contracts.registry import Role
from infra.cores import default_routers
from node_agent.model import default_model_dir


@dataclass(frozen=True)
class ModelSpec:
    """One served model of a several-model cluster: its nodes serve ``path`` as ``name``."""

    name: str
    """The served name (``--served-model-name``): what clients put in ``model``."""
    path: str | None = None
    """Model folder; None: the prepared default model."""
    dtype: str | None = None
    """Engine dtype of this model's nodes; None: the cluster's ``dtype``."""


def parse_model_option(value: str) -> ModelSpec:
    """``tandem up --model NAME=PATH`` (PATH empty: the prepared default model)."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"--model {value!r}: expected NAME=PATH (or a folder alone, for one model)")
    return ModelSpec(name=name.strip(), path=path.strip() or None)


def models_from_file(path: Path) -> tuple[ModelSpec, ...]:
    """The ``[served]`` models of a models file (``contracts.models_file``), checked as the router
    will check it, before any node starts."""
    spec = read_models_file(path)
    check_models(spec, str(path))
    return tuple(ModelSpec(name, m.path or None, m.dtype) for name, m in spec.served.items())


@dataclass(frozen=True)
class ClusterSpec:
    prefill: int = 1
    decode: int = 1
    both: int = 0
    model: str | None = None
    models: tuple[ModelSpec, ...] = ()
    """Several served models: ``prefill``/``decode``/``both`` nodes of each (``model`` is then unused).
    Empty: one model, ``model``, under its folder's name."""
    models_file: Path | None = None
    """The routers' model table (``TANDEM_ROUTER_MODELS``: aliases, fallbacks, canaries)."""
    router_port: int = 8000
    cluster: str | None = None
    """The cluster's name (``contracts.cluster``), given to every child as ``TANDEM_CLUSTER``; None: derived
    from ``router_port`` (``default`` on 8000, else ``p<port>``)."""
    node_base_port: int = 8100
    """Node i listens on node_base_port + 10*i (its side ports are the next three)."""
    redis_url: str | None = None
    """None: ``TANDEM_REDIS_URL`` (``contracts.config``) if it answers, else an embedded server on redis_port."""
    redis_port: int = 6390
    embedded_redis: bool = False
    """Start an embedded Redis on redis_port even if one answers at redis_url or the default (a
    benchmark that restarts Redis must own the one it restarts)."""
    dtype: str | None = None
    """Engine settings of every node; None leaves each to the node's own setting (``TANDEM_NODE_DTYPE``
    and so on in the environment, else ``NodeSettings``' default)."""
    kv_cache_gib: int | None = None
    connector: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    """KV block size of every node; None keeps the engine's default (128 on CPU)."""
    policy: str | None = None
    """The router's routing policy; None leaves it to ``TANDEM_ROUTER_POLICY``, else cache_aware."""
    workdir: Path = field(default_factory=lambda: Path(".tandem"))
    lake: Path | None = None
    """Parquet lake the cluster's telemetry writer fills; None: <workdir>/lake. Telemetry is always on:
    the emitters never block serving, so there is no reason to run without the records."""
    startup_timeout_s: float = 600.0
    extra_node_args: tuple[str, ...] = ()
    router_env: tuple[tuple[str, str], ...] = ()
    node_env: tuple[tuple[str, str], ...] = ()
    """Environment of every node process on top of this one's (``TANDEM_NODE_*`` settings)."""
    host_tier: str | None = None
    """Size of a host tier every node shares (``2GiB``; ``tandem tier serve``); None: no host tier.
    A spec is taken as given; ``tandem up`` fills this and ``peer_kv`` by ``infra.shared_cache``'s rule
    (on from four colocated nodes of one model, measured) unless its options name them."""
    tier_env: tuple[tuple[str, str], ...] = ()
    """Environment of the host tier's process on top of this one's (``TANDEM_TIER_*`` settings)."""
    keep_host_tier: bool = False
    """Leave the tier's file (its blocks, and the RAM they take in /dev/shm) after ``stop``, for the next
    start to find; by default a stopped cluster gives the RAM back."""
    peer_kv: bool = False
    """Colocated nodes run our connector, so each loads a prefix another holds instead of computing it
    (``NodeSettings.peer_kv``; the router's ``peer_fetch``)."""
    routers: int | None = None
    """Router replicas sharing router_port (SO_REUSEPORT): one that dies, or restarts, leaves the other
    serving. The first is named ``router``, the others ``router-1``... None: ``default_routers()``."""

    @property
    def router_count(self) -> int:
        return self.routers if self.routers is not None else default_routers()

    @property
    def model_paths(self) -> list[str]:
        """The model folders the nodes register, which every router warms before it serves."""
        paths = [m.path for m in self.models] if self.models else [self.model]
        return [str(Path(p).expanduser()) if p else str(default_model_dir()) for p in paths]

    @property
    def roles(self) -> list[Role]:
        """The roles of one model's nodes."""
        return [Role.PREFILL] * self.prefill + [Role.DECODE] * self.decode + [Role.BOTH] * self.both

    @property
    def nodes(self) -> list[tuple[Role, ModelSpec | None]]:
        """Every node to start: its role and served model (None: the single ``model``)."""
        if not self.models:
            return [(role, None) for role in self.roles]
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError(f"served model names must differ: {', '.join(names)}")
        return [(role, m) for m in self.models for role in self.roles]
