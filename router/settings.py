"""Settings of the router process: one typed object, built once at start-up and passed down."""

from __future__ import annotations

import enum

from pydantic_settings import BaseSettings, SettingsConfigDict

from router.admission.context import AdmissionSettings


class FallbackPolicy(enum.StrEnum):
    """What to do when the prefill leg fails for a reason that is not the client's (node died,
    connection refused, 5xx): like vLLM's kv_load_failure_policy, an explicit choice."""

    LOCAL = "local"  # prefill on the decode node instead (no transfer); the client never notices
    ERROR = "error"  # return a 502 to the client


class RouterSettings(BaseSettings):
    """Every field can also come from the environment as ``TANDEM_ROUTER_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_ROUTER_", frozen=True)

    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    policy: str = "cache_aware"
    """cache_aware (default), least_loaded or round_robin (router.policies)."""
    registry_refresh_s: float = 1.0
    """How often the live-node view is re-read from Redis. Nodes heartbeat their load every 2 s, so a
    faster refresh buys no fresher loads, only idle CPU taken from the engines on a shared host."""
    prefill_fallback: FallbackPolicy = FallbackPolicy.LOCAL
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    """Upper bound on one upstream call (a whole non-streamed answer, or the gap between two chunks)."""
    retry_after_s: float = 2.0
    """Retry-After sent with 503 when no node can take a request."""
    telemetry: bool = True
    """Emit a per-request record to the slow path (Redis Stream -> Parquet lake)."""
    telemetry_redis_url: str | None = None
    """Redis for telemetry streams; None uses redis_url."""
    admission: AdmissionSettings | None = None
    """Keys, rate limits and sessions; None reads them from the environment (TANDEM_*) with this
    router's redis_url."""
    default_max_tokens: int | None = None
    """max_tokens applied when a request gives none (None: up to the context window, as vLLM does)."""
