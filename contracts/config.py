"""Settings every Tandem process shares, each with one name and one default.

``TANDEM_REDIS_URL`` is the one Redis setting: the registry, the router's keys, limits and session
cache, and the telemetry streams all read it (a process may still be handed a URL explicitly, e.g.
``--redis-url``). Nothing else names a Redis address; benchmarks that need a database of their own
take this URL with another database number (``redis_url(db=9)``).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

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
