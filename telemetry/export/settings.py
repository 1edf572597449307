"""Settings of ``tandem lake export``: one typed object, built once per run.

The session store is the router's: the same ``TANDEM_DATABASE_URL`` / ``TANDEM_SQLITE_PATH`` the router
and ``tandem keys`` read, so the export finds the turns ``tandem up`` stored without a second name for
them. Consent, watermarks and the manifest of written parts live in that same database.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ExportSettings(BaseSettings):
    """Every field is ``TANDEM_EXPORT_<FIELD>`` in the environment, but the database's two, which are the
    router's own ``TANDEM_DATABASE_URL`` and ``TANDEM_SQLITE_PATH``."""

    model_config = SettingsConfigDict(
        env_prefix="TANDEM_EXPORT_", frozen=True, extra="ignore", validate_by_name=True, validate_by_alias=True
    )

    database_url: str | None = Field(default=None, validation_alias="TANDEM_DATABASE_URL")
    """``postgresql://user@host:port/db`` (optionally ``?schema=name``); None → SQLite at ``sqlite_path``."""
    sqlite_path: Path = Field(default=Path(".tandem/tandem.db"), validation_alias="TANDEM_SQLITE_PATH")
    """The embedded session store (SQLite) when no database URL is given: where ``tandem up`` keeps it."""
    redact: str | None = None
    """The redaction hook, ``module:function``: called with each example (``{"messages": [...],
    "metadata": {...}}``, the chat shape) before anything is written; returns the example to write (it
    may change it) or None to leave it out. None: no hook."""
    settle_s: float = Field(default=120.0, ge=0.0)
    """Turns (and feedback) younger than this are left for the next run: the session writer and the lake
    writer may still be delivering rows that end before them, and the watermark never moves back."""
    batch_rows: int = Field(default=1000, ge=1)
    """Rows per part file; the watermark advances after each part is durable."""
    run_max_turns: int = Field(default=0, ge=0)
    """Turns one chat or Parquet run reads past its watermark at most (turns ending at the same instant
    as the last are read with it), so a first export of a large store runs in bounded memory: each run
    takes the next slice. 0: no bound."""
    s3_endpoint_url: str | None = None
    """Endpoint of an S3-API server for ``s3://`` destinations (MinIO, moto, a region's endpoint);
    None: AWS's own, found the way botocore finds it."""
    s3_region: str | None = None
    """Region the S3 client signs for (``us-east-1`` suits most S3-API servers); None: botocore's default."""
    s3_access_key_id: str | None = None
    """None: credentials from botocore's usual chain (``AWS_*`` variables, profiles, instance roles)."""
    s3_secret_access_key: str | None = None
    """The secret of ``s3_access_key_id``; keep it in a secret store's environment, not in a file."""
    fault_kill_after_parts: int = Field(default=0, ge=0)
    """Fault injection for tests: after this many parts are durable, the export SIGKILLs itself before
    committing the last one's watermark (the window a crash is most likely to hurt). 0: never."""

    def store_url(self) -> str:
        return self.database_url or f"sqlite:///{self.sqlite_path}"

    def storage_options(self, uri: str) -> dict[str, Any]:
        """fsspec options for ``uri``'s filesystem (only ``s3://`` takes any)."""
        if not uri.startswith(("s3://", "s3a://")):
            return {}
        opts: dict[str, Any] = {}
        if self.s3_endpoint_url:
            opts["endpoint_url"] = self.s3_endpoint_url
        if self.s3_access_key_id:
            opts["key"] = self.s3_access_key_id
        if self.s3_secret_access_key:
            opts["secret"] = self.s3_secret_access_key
        if self.s3_region:
            opts["client_kwargs"] = {"region_name": self.s3_region}
        return opts
