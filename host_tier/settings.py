"""Settings of one host tier process (``tandem tier serve``): one typed object, built once."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import ByteSize, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from contracts.cluster import CLUSTER_ENV, DEFAULT_CLUSTER, NAME_PATTERN, suffix
from host_tier.layout import BlockLayout

DEFAULT_DIR = Path("/dev/shm")
"""tmpfs: the tier is RAM, shared by every process on the host, and survives every one of them."""


class TierSettings(BaseSettings):
    """Every field can also come from the environment as ``TANDEM_TIER_<FIELD>``."""

    model_config = SettingsConfigDict(
        env_prefix="TANDEM_TIER_", frozen=True, validate_by_name=True, validate_by_alias=True
    )

    size: ByteSize = Field(default=ByteSize(1 << 30))
    """Bytes of block data the tier may hold (``2GiB``, ``512MB``): the bound, fixed at start."""
    dir: Path = DEFAULT_DIR
    endpoint: str = "ipc:///tmp/tandem-tier.sock"
    """Control socket (ZeroMQ). Loopback or ipc only: the tier serves one host."""
    events_endpoint: str | None = "ipc:///tmp/tandem-tier-events.sock"
    """Where store/remove events are published (vLLM's KV-event format); None: none."""
    replay_endpoint: str | None = "ipc:///tmp/tandem-tier-replay.sock"
    """Where a subscriber catching up gets a snapshot of the blocks held (``events.py``); None: none."""
    tenant_pin_share: float = Field(default=0.5, gt=0.0, le=1.0)
    """The share of the tier one tenant's session pins may hold: one tenant's long sessions cannot pin
    everyone else's context out."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1 at this port (``host_tier.metrics``); None: none."""
    write_timeout_s: float = 30.0
    """A reservation not committed within this is taken back (its writer is gone)."""
    telemetry_redis_url: str | None = None
    """Redis holding the telemetry streams: the tier emits a ``host_tier`` row there per interval for the
    lake (``host_tier.lake``; ``tandem up --host-tier`` passes the cluster's); None: no rows."""
    telemetry_stream_prefix: str = "tandem:telemetry"
    """The streams' prefix (``telemetry.emitter.DEFAULT_STREAM_PREFIX``, spelled out here: engines load
    these settings, and must not load the telemetry package with them)."""
    telemetry_interval_s: float = Field(default=10.0, gt=0.0)
    """Seconds one ``host_tier`` row covers."""

    cluster: str = Field(default=DEFAULT_CLUSTER, validation_alias=CLUSTER_ENV, pattern=NAME_PATTERN)
    """The cluster this tier serves (``TANDEM_CLUSTER``): its file is named after it as well as the model,
    so two clusters of one model on a host never share a tier (``contracts.cluster``)."""

    def path_for(self, layout: BlockLayout) -> Path:
        return self.dir / f"tandem-tier{suffix(self.cluster)}-{layout.fingerprint().hex()[:16]}"

    def own_files(self) -> list[Path]:
        """This cluster's tier files in ``dir``, of any model (``path_for``'s names): what ``tandem tier
        clear`` removes. Another cluster's (``tandem-tier-NAME-...``) never match, the default cluster's
        included."""
        name = re.compile(rf"tandem-tier{re.escape(suffix(self.cluster))}-[0-9a-f]{{16}}")
        return sorted(p for p in self.dir.glob("tandem-tier-*") if name.fullmatch(p.name))

    def n_slots(self, layout: BlockLayout) -> int:
        n = int(self.size) // layout.block_bytes
        if n < 1:
            raise ValueError(f"a tier of {int(self.size)} bytes holds no block of {layout.block_bytes} bytes")
        return n


def layout_from_model(model: Path, dtype: str, block_size: int, hash_seed: str | None = None) -> BlockLayout:
    """The block layout an engine of this Hugging Face folder computes (its ``config.json``)."""
    cfg = json.loads((model / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    return BlockLayout(
        model=model.name,
        dtype=dtype,
        block_size=block_size,
        num_layers=int(cfg["num_hidden_layers"]),
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        hash_seed=hash_seed,
    )
