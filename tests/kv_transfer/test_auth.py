"""Where the cluster secret comes from (``contracts/secret.py``): the environment, a private file, or the
per-user default file, which only loopback-only nodes may use and which racing processes agree on; and
peer credentials, which only a Unix socket carries."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from pathlib import Path

import pytest
import zmq

from contracts.errors import ConfigError
from contracts.secret import SECRET_ENV, SECRET_FILE_ENV, default_secret_path, load_cluster_secret
from kv_transfer.auth import peer_credentials
from kv_transfer.settings import ConnectorSettings

GOOD = "s" * 40


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No secret in the environment; the default file under a fresh state dir."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    return tmp_path


def test_the_environment_wins_and_short_secrets_are_refused(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, GOOD)
    assert load_cluster_secret(loopback_only=False) == GOOD.encode()
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ConfigError, match="at least 32"):
        load_cluster_secret(loopback_only=True)


def test_a_secret_file_must_be_private(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = clean_env / "secret"
    f.write_text(GOOD + "\n")
    f.chmod(0o600)
    monkeypatch.setenv(SECRET_FILE_ENV, str(f))
    assert load_cluster_secret(loopback_only=False) == GOOD.encode()
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        load_cluster_secret(loopback_only=False)
    monkeypatch.setenv(SECRET_FILE_ENV, str(clean_env / "missing"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster_secret(loopback_only=True)


def test_a_node_on_a_real_interface_needs_an_explicit_secret(clean_env: Path) -> None:
    with pytest.raises(ConfigError, match="non-loopback"):
        load_cluster_secret(loopback_only=False)
    s = ConnectorSettings(host="10.0.0.5", port=9103)
    assert not s.binds_loopback_only
    with pytest.raises(ConfigError, match="non-loopback"):
        s.codec()
    assert ConnectorSettings(host="10.0.0.5", bind_host="127.0.0.1").binds_loopback_only
    assert not default_secret_path().exists()  # nothing was generated for it


def _load(_: int) -> bytes:
    return load_cluster_secret(loopback_only=True)


def test_loopback_nodes_share_a_generated_private_default(clean_env: Path) -> None:
    with mp.get_context("spawn").Pool(4) as pool:  # racing first uses, in separate processes
        secrets = set(pool.map(_load, range(8)))
    assert len(secrets) == 1 and len(secrets.pop()) == 64
    path = default_secret_path()
    assert path.parent == clean_env / "tandem"
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["cluster-secret"]  # no temporary file left behind
    assert ConnectorSettings().codec() is not None


def test_only_a_unix_socket_carries_peer_credentials() -> None:
    ctx = zmq.Context.instance()
    d = tempfile.mkdtemp(prefix="tandem-cred-")
    with ctx.socket(zmq.ROUTER) as server:
        port = server.bind_to_random_port("tcp://127.0.0.1")
        server.bind(f"ipc://{d}/s")
        for ep, local in ((f"tcp://127.0.0.1:{port}", False), (f"ipc://{d}/s", True)):
            with ctx.socket(zmq.DEALER) as client:
                client.connect(ep)
                client.send(b"x")
                assert server.poll(5000)
                frame = server.recv_multipart(copy=False)[1]
                cred = peer_credentials(frame)
                if local:
                    assert cred is not None and (cred.uid, cred.pid) == (os.getuid(), os.getpid())
                else:
                    assert cred is None
