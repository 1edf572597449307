"""The cluster secret: what every process of the cluster holds and nothing else does. It keys the MAC of
every KV-wire control message (``kv_transfer.wire.Codec``), the engines' API key and the CURVE keys of the
KV-event relays; it lives here, at the bottom of the layers, because the router, the node agent, the
benchmarks and the KV path all use it.

The cluster secret
    One secret for the whole cluster (every node, the router, the tools that arm faults): it keys an
    HMAC-SHA256 over every control message on the KV wire (``kv_transfer/wire.py``). It comes from, first match:

    1. ``TANDEM_CLUSTER_SECRET``: the secret itself (at least 32 characters, e.g. ``openssl rand -hex 32``).
    2. ``TANDEM_CLUSTER_SECRET_FILE`` (or ``ConnectorSettings.cluster_secret_file``): a file holding it,
       readable by its owner only (like an ssh key: a group- or world-readable file is refused).
    3. Neither set: a per-user default file, ``$XDG_STATE_HOME/tandem/cluster-secret`` (else
       ``~/.local/state/tandem/cluster-secret``), created on first use with 32 random bytes (hex),
       mode 0600. Every process of one user on one host shares it, so a loopback cluster
       (``tandem up``, the tests) needs no setup. **Only for loopback**: a node that binds a
       non-loopback address refuses to start without 1 or 2 (``ConfigError``), because each host would
       generate its own secret and no node could talk to another.

    The secret never goes on a command line (``--kv-transfer-config`` is visible in ``ps``): nodes pass
    it to their engines through the environment they inherit, or as a file path.

What this does not cover (see README, Security): block data frames are integrity-checked by the xxh3
checksums their (authenticated) LayerHeader carries, which catch accidents, not a forger on the path;
and nothing on the KV wire is encrypted. Across untrusted networks put the nodes on an encrypted link
(WireGuard, IPsec) or extend the wire to ZeroMQ CURVE.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from contracts.cluster import suffix
from contracts.config import SECRET_ENV, SECRET_FILE_ENV, SharedSettings, shared_settings
from contracts.errors import ConfigError
from contracts.registry import set_local_secret

MIN_SECRET_CHARS = 32
"""32 hex characters are 128 bits: below that a secret is guessable offline from one captured MAC."""


def default_secret_path(env: SharedSettings | None = None) -> Path:
    env = env or shared_settings()
    state = env.state_home or Path.home() / ".local" / "state"
    # one default secret per cluster name (contracts.cluster): clusters of one user never share it
    return state / "tandem" / f"cluster-secret{suffix(env.cluster)}"


def load_cluster_secret(*, secret_file: str | Path | None = None, loopback_only: bool) -> bytes:
    """The cluster secret, by the policy in this module's docstring. ``loopback_only``: every address
    this process binds is a loopback one (the default file is allowed then, and only then)."""
    env = shared_settings()
    text = env.cluster_secret.get_secret_value() if env.cluster_secret else None
    source = f"${SECRET_ENV}"
    if not text:
        path = secret_file or env.cluster_secret_file
        if path:
            text, source = _read_private(Path(path)), str(path)
        elif not loopback_only:
            raise ConfigError(
                f"this node binds a non-loopback address: set {SECRET_ENV} (or {SECRET_FILE_ENV}), "
                "the same on every host of the cluster"
            )
        else:
            path = default_secret_path(env)
            _create_default(path)
            text, source = _read_private(path), str(path)
    text = text.strip()
    if len(text) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"the cluster secret from {source} has {len(text)} characters; at least {MIN_SECRET_CHARS} are needed"
        )
    return text.encode()


def engine_api_key(secret: bytes) -> str:
    """The API key of every engine of the cluster (vLLM's ``VLLM_API_KEY``): a derivation of the cluster
    secret, so the node agents that start engines and the routers that call them hold it with no setup
    of their own, and nothing else does. vLLM checks it on ``/v1/*`` only (not ``/health``,
    ``/metrics``, ``/tokenize``): an engine port reached from outside serves no generation."""
    return hmac.new(secret, b"tandem engine api key v1", hashlib.sha256).hexdigest()


def cluster_engine_api_key(*, loopback_only: bool) -> str:
    """``engine_api_key`` of this process's cluster secret (``load_cluster_secret``), read at every call:
    its callers ask once per engine start or client, and a cached key would outlive a change of the
    secret's environment (one test process starting clusters under different secrets)."""
    return engine_api_key(load_cluster_secret(loopback_only=loopback_only))


def engine_auth_headers(*, loopback_only: bool) -> dict[str, str]:
    """What a caller of an engine's ``/v1/*`` sends."""
    return {"Authorization": f"Bearer {cluster_engine_api_key(loopback_only=loopback_only)}"}


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """ZeroMQ CURVE keys (z85) of the KV-event relays (``node_agent.kv_events_relay``) and their clients
    (routers), derived from the cluster secret: CURVE encrypts the events (their token ids are tenants'
    prompts) and the server admits only ``client_public``, so holding the secret is the credential."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_keys(secret: bytes) -> CurveKeys:
    def pair(label: bytes) -> tuple[bytes, bytes]:
        private = z85.encode(hmac.new(secret, label, hashlib.sha256).digest())  # any 32 bytes are a key
        return zmq.curve_public(private), private

    server_public, server_secret = pair(b"tandem kv events curve server v1")
    client_public, client_secret = pair(b"tandem kv events curve client v1")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def _read_private(path: Path) -> str:
    try:
        st = path.stat()
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"cluster secret file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it"
            )
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the cluster secret file {path}: {exc}") from exc


def _create_default(path: Path) -> None:
    """Create the per-user default secret once; safe when several processes start at the same time:
    the secret is written to a temporary file and linked into place, so no reader ever sees a
    partial file and the first link wins."""
    if path.exists():
        return
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cluster-secret-")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process won the race; its secret is the one
        finally:
            os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(f"cannot create the default cluster secret {path}: {exc}") from exc


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1")


set_local_secret(lambda: load_cluster_secret(loopback_only=True))  # registry entries this process writes prove it
