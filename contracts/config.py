"""Settings every Tandem process shares, each with one name and one default.

``TANDEM_REDIS_URL`` is the one Redis setting: the registry, the router's keys, limits and session
cache, and the telemetry streams all read it (a process may still be handed a URL explicitly, e.g.
``--redis-url``). Nothing else names a Redis address; benchmarks that need a database of their own
take this URL with another database number (``redis_url(db=9)``).

``TANDEM_LAKE_DIR`` is the telemetry lake's one setting, read through ``lake_dir``: the ``--lake`` flag,
else this variable, else ``<default workdir>/lake`` (where ``tandem up`` writes: ``.tandem/lake``, or
``.tandem/<name>/lake`` for a cluster named by ``TANDEM_CLUSTER``). The lake writer ``tandem up``
starts, ``tandem telemetry consume|compact`` and ``tandem lake query|report|questions`` all resolve it
there, so every command sees the same lake.

``SharedSettings`` is the one reader of this environment contract between processes (the launcher sets
these variables for its children, a user sets them for a command): the Redis URL, the cluster name, the
lake, the cluster secret (``contracts.secret``), the model home and the engines' hash seed. Nothing
else in the project reads them from ``os.environ``; a process's own settings class may name the same
variable for a field of its own (``RouterSettings.redis_url``), so that one variable has one meaning.
It is built afresh by each call of ``shared_settings()`` (a few microseconds, and only at start-up or
per command), so a test's ``monkeypatch.setenv`` is seen like a parent's environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from contracts.cluster import CLUSTER_ENV, DEFAULT_CLUSTER, validate

REDIS_URL_ENV = "TANDEM_REDIS_URL"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
LAKE_DIR_ENV = "TANDEM_LAKE_DIR"
SECRET_ENV = "TANDEM_CLUSTER_SECRET"
SECRET_FILE_ENV = "TANDEM_CLUSTER_SECRET_FILE"


class SharedSettings(BaseSettings):
    """The variables every process of a cluster may read, each under its own full name (no prefix)."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", env_ignore_empty=True)

    redis_url: str = Field(default=DEFAULT_REDIS_URL, validation_alias=REDIS_URL_ENV)
    """The cluster's Redis: registry, keys, limits, session cache, telemetry streams (``redis_url``)."""
    cluster: str = Field(default=DEFAULT_CLUSTER, validation_alias=CLUSTER_ENV)
    """The cluster this process belongs to (``tandem up --cluster`` sets it for its children): every Redis
    key and host path it uses is under it (``contracts.cluster``, which validates the name where it is
    used, so a bad name stops what uses it and nothing else)."""
    lake_dir: Path | None = Field(default=None, validation_alias=LAKE_DIR_ENV)
    """The telemetry lake (``lake_dir``); None: ``<workdir>/lake``, where ``tandem up`` writes it."""
    cluster_secret: SecretStr | None = Field(default=None, validation_alias=SECRET_ENV)
    """The cluster secret itself, at least 32 characters (``contracts.secret``). Never on a command line."""
    cluster_secret_file: Path | None = Field(default=None, validation_alias=SECRET_FILE_ENV)
    """A file holding the cluster secret, readable by its owner only (``contracts.secret``)."""
    state_home: Path | None = Field(default=None, validation_alias="XDG_STATE_HOME")
    """Where the per-user default cluster secret lives (``<this>/tandem``); None: ``~/.local/state``."""
    home: Path = Field(default_factory=lambda: Path.home() / ".cache" / "tandem", validation_alias="TANDEM_HOME")
    """Tandem's cache folder: ``tandem model prepare`` puts the default model under ``<this>/models``."""
    hash_seed: str | None = Field(default=None, validation_alias="PYTHONHASHSEED")
    """The engines' ``PYTHONHASHSEED``: vLLM seeds its prefix-cache block hashes with it, so every reader
    of KV layouts (host tier, benchmarks) must use the same one. None: vLLM's fixed seed."""


def section_env(section: type[BaseModel], prefix: str, *, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The values the environment sets for a settings section (a plain model nested in a process's root
    settings): ``<prefix><FIELD>``, or the field's alias (an ``AliasChoices`` also finds a deprecated name),
    parsed as pydantic-settings parses a variable (JSON for lists and maps). ``skip``: fields the root
    hands down itself."""
    source = EnvSettingsSource(section, env_prefix=prefix, case_sensitive=False, env_ignore_empty=True)  # type: ignore[arg-type]
    return {name: value for name, value in source().items() if name not in skip}


def shared_settings() -> SharedSettings:
    """The shared variables as the environment holds them now."""
    return SharedSettings()


def redis_url(*, db: int | None = None) -> str:
    """``TANDEM_REDIS_URL`` if set, else the default; with ``db``, the same server's database ``db``."""
    url = shared_settings().redis_url
    return url if db is None else with_db(url, db)


def redacted(url: str) -> str:
    """``url`` fit for a log line: a password in it (``redis://:secret@host``, as a Kubernetes Secret
    hands it over) becomes ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host  # an IPv6 address keeps its brackets
    netloc = f"{user}***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def with_db(url: str, db: int) -> str:
    """``url`` pointing at database ``db`` of the same server (``redis://h:p/0`` -> ``redis://h:p/9``)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


# --- the telemetry lake -------------------------------------------------------------------------
DEFAULT_WORKDIR = Path(".tandem")
"""``tandem up``'s working folder (logs, embedded Redis data, the lake) for the cluster ``default``."""
DEFAULT_LAKE_DIR = DEFAULT_WORKDIR / "lake"


def default_workdir(cluster: str | None = None) -> Path:
    """``tandem up``'s working folder for ``cluster`` (None: ``$TANDEM_CLUSTER``): ``.tandem`` for
    ``default``, as before cluster names, and ``.tandem/<name>`` for a named one, so two clusters started
    from one folder keep their logs, lakes, journals and SQLite stores apart."""
    name = validate(cluster or shared_settings().cluster)
    return DEFAULT_WORKDIR if name == DEFAULT_CLUSTER else DEFAULT_WORKDIR / name


@dataclass(frozen=True, slots=True)
class LakeLocation:
    """Where the Parquet lake is, and which rule said so (for messages: "no lake at X (from Y)")."""

    path: Path
    source: str
    """``--lake``, ``$TANDEM_LAKE_DIR`` or ``default``."""


def lake_dir(flag: Path | None = None, *, workdir: Path | None = None) -> LakeLocation:
    """The one lake resolver of every command that reads or writes the lake: the ``--lake`` flag when
    given, else ``$TANDEM_LAKE_DIR`` when set, else ``<workdir>/lake`` (``workdir`` defaults to
    ``default_workdir()``, the folder ``tandem up`` uses for the cluster of ``$TANDEM_CLUSTER``, so
    ``tandem lake query`` finds what ``tandem up`` wrote)."""
    if flag is not None:
        return LakeLocation(Path(flag), "--lake")
    env = shared_settings().lake_dir
    if env is not None:
        return LakeLocation(env, f"${LAKE_DIR_ENV}")
    return LakeLocation((workdir or default_workdir()) / "lake", "default")
