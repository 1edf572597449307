"""``tandem keys create|list|revoke`` through typer's runner, against real Redis and SQLite."""

import hashlib

import pytest
from typer.testing import CliRunner

from router.admission.cli import keys_app
from tests.router.admission.support import REDIS_A


@pytest.fixture
def env(monkeypatch, tmp_path, prefix, redis_a) -> dict[str, str]:
    values = {
        "TANDEM_REDIS_URL": REDIS_A,
        "TANDEM_KEY_PREFIX": prefix,
        "TANDEM_SQLITE_PATH": str(tmp_path / "tandem.db"),
    }
    monkeypatch.delenv("TANDEM_DATABASE_URL", raising=False)
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    return values


def test_create_list_revoke(env):
    runner = CliRunner()
    created = runner.invoke(keys_app, ["create", "--tenant", "acme", "--rpm", "60", "--priority", "batch"])
    assert created.exit_code == 0, created.output
    key = created.stdout.strip()
    assert key.startswith("tdm-") and len(key.splitlines()) == 1  # stdout is exactly the key
    key_id = key[4:12]
    assert "will not be shown again" in created.stderr

    listed = runner.invoke(keys_app, ["list"], terminal_width=200)
    assert listed.exit_code == 0, listed.output
    assert key_id in listed.stdout and "acme" in listed.stdout and "batch" in listed.stdout
    assert "active" in listed.stdout
    assert key not in listed.stdout and key[13:] not in listed.stdout
    assert hashlib.sha256(key.encode()).hexdigest() not in listed.stdout

    revoked = runner.invoke(keys_app, ["revoke", key_id])
    assert revoked.exit_code == 0, revoked.output
    assert "revoked" in runner.invoke(keys_app, ["list", "--tenant", "acme"], terminal_width=200).stdout

    missing = runner.invoke(keys_app, ["revoke", "ffffffff"])
    assert missing.exit_code == 1 and "no API key" in missing.stderr
    bad = runner.invoke(keys_app, ["create", "--tenant", "bad tenant"])
    assert bad.exit_code == 1


def test_help_explains_the_commands():
    out = CliRunner().invoke(keys_app, ["--help"]).stdout
    assert "create" in out and "list" in out and "revoke" in out
    create_help = CliRunner().invoke(keys_app, ["create", "--help"]).stdout
    assert "--tenant" in create_help and "--tpm" in create_help and "shown again" in create_help
