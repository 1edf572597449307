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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from contracts.cluster import CLUSTER_ENV, DEFAULT_CLUSTER, validate

REDIS_URL_ENV = "TANDEM_REDIS_URL"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url(*, db: int | None = None) -> str:
    """``TANDEM_REDIS_URL`` if set, else the default; with ``db``, the same server's database ``db``."""
    url = os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL
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
LAKE_DIR_ENV = "TANDEM_LAKE_DIR"
DEFAULT_WORKDIR = Path(".tandem")
"""``tandem up``'s working folder (logs, embedded Redis data, the lake) for the cluster ``default``."""
DEFAULT_LAKE_DIR = DEFAULT_WORKDIR / "lake"


def default_workdir(cluster: str | None = None) -> Path:
    """``tandem up``'s working folder for ``cluster`` (None: ``$TANDEM_CLUSTER``): ``.tandem`` for
    ``default``, as before cluster names, and ``.tandem/<name>`` for a named one, so two clusters started
    from one folder keep their logs, lakes, journals and SQLite stores apart."""
    name = validate(cluster or os.environ.get(CLUSTER_ENV) or DEFAULT_CLUSTER)
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
    env = os.environ.get(LAKE_DIR_ENV)
    if env:
        return LakeLocation(Path(env), f"${LAKE_DIR_ENV}")
    return LakeLocation((workdir or default_workdir()) / "lake", "default")
