"""The cluster name: what keeps several Tandem clusters on one host and one Redis apart.

Every shared resource a cluster touches is named here, never by hand elsewhere: its Redis keys
(``key``) and its host paths (``runtime_dir``). Two clusters with different names therefore share no
registry, node status, API key, limit, session, response id or telemetry stream, and no tier file or
socket, though they share a Redis server, ``/tmp`` and ``/dev/shm`` (the key-prefix scheme of Celery,
RQ or Ray's namespaces).

Every process of a cluster reads its name from ``TANDEM_CLUSTER`` (``CLUSTER_ENV``), which the launcher
sets for its children from ``tandem up --cluster``. Without one, a cluster is ``default``: every process
of an unnamed cluster agrees on it without being told (a name derived from the router port was tried,
but a node or tool started by hand beside ``tandem up`` on another port then read another cluster's
keys); a second cluster on the same host and Redis must be given a name.

Upgrading: the cluster ``default`` keeps today's unprefixed keys (``tandem:nodes``, ``tandem:node:<id>``,
...) and paths, so a single cluster that ran before cluster names existed is read as it was written,
with no migration step. Every other name gets ``tandem:<name>:`` before the rest of the key, and its
own runtime directory.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

CLUSTER_ENV = "TANDEM_CLUSTER"
DEFAULT_CLUSTER = "default"
DEFAULT_ROUTER_PORT = 8000
"""The router port whose cluster is ``default`` (``RouterSettings.port``'s default)."""

NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"
_NAME = re.compile(NAME_PATTERN)
"""Lower-case letters, digits and dashes, at most 40: safe in a Redis key, a file name and a Helm
release name alike, with no ``:`` or ``/`` that could reach into another cluster's keys or paths."""

RUNTIME_ROOT = Path(tempfile.gettempdir()) / "tandem"


def validate(name: str) -> str:
    """``name`` if it is a valid cluster name, else ``ValueError`` (saying what a name may hold)."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"cluster name {name!r}: use 1-40 lower-case letters, digits or dashes, starting with a letter or digit"
        )
    return name


def prefix(name: str) -> str:
    """The Redis key prefix of a cluster, ending in ``:`` (``tandem:`` for ``default``)."""
    return "tandem:" if validate(name) == DEFAULT_CLUSTER else f"tandem:{name}:"


def key(name: str, *parts: str) -> str:
    """A Redis key of cluster ``name``: ``key("a", "node", "n1")`` is ``tandem:a:node:n1``."""
    return prefix(name) + ":".join(parts)


def runtime_dir(name: str) -> Path:
    """The host directory of cluster ``name``'s sockets and private files (not created here)."""
    return RUNTIME_ROOT if validate(name) == DEFAULT_CLUSTER else RUNTIME_ROOT / name


def suffix(name: str) -> str:
    """What a host file name shared under ``/dev/shm`` or ``/tmp`` gets: ``""`` for ``default``."""
    return "" if validate(name) == DEFAULT_CLUSTER else f"-{name}"
