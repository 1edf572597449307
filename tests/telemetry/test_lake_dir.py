"""One lake: every command that reads or writes it resolves it the same way (``--lake``, then
``$TANDEM_LAKE_DIR``, then ``.tandem/lake``, where ``tandem up`` writes), and a command pointed at no
lake says so on stderr and exits non-zero."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from contracts.config import DEFAULT_LAKE_DIR, LAKE_DIR_ENV, lake_dir
from tandem.cli import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_lake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LAKE_DIR_ENV, raising=False)


def _write_requests(make_emitter, make_writer, lake: Path, n: int = 3) -> None:
    e = make_emitter(start=False)
    for i in range(n):
        e.emit("requests", {"request_id": f"r{i}", "prompt_tokens": 10, "status": "ok", "event_time": time.time()})
    e.flush()
    assert make_writer(lake=lake).drain().rows == n


def test_resolver_order_flag_then_environment_then_tandem_up_default(monkeypatch, tmp_path):
    assert lake_dir() == lake_dir(None)
    assert lake_dir().path == DEFAULT_LAKE_DIR == Path(".tandem/lake") and lake_dir().source == "default"
    assert lake_dir(workdir=tmp_path / "w").path == tmp_path / "w" / "lake"
    monkeypatch.setenv(LAKE_DIR_ENV, str(tmp_path / "env"))
    assert lake_dir().path == tmp_path / "env" and lake_dir().source == f"${LAKE_DIR_ENV}"
    assert lake_dir(workdir=tmp_path / "w").path == tmp_path / "env"  # the variable beats tandem up's workdir
    assert lake_dir(tmp_path / "flag") == lake_dir(tmp_path / "flag", workdir=tmp_path / "w")
    assert lake_dir(tmp_path / "flag").path == tmp_path / "flag" and lake_dir(tmp_path / "flag").source == "--lake"


class _Captured(Exception):
    pass


def _spec_of_up(monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    """The ClusterSpec `tandem up ARGS` would start (the launcher replaced by a recorder: nothing starts)."""
    import infra.launcher

    seen: list[Any] = []

    class Recorder:
        def __init__(self, spec: Any) -> None:
            seen.append(spec)
            raise _Captured

    monkeypatch.setattr(infra.launcher, "Cluster", Recorder)
    res = runner.invoke(app, ["up", *args])
    assert isinstance(res.exception, _Captured), res.output
    return seen[0]


def test_tandem_up_writes_where_lake_commands_look(monkeypatch, tmp_path):
    assert _spec_of_up(monkeypatch).lake == lake_dir().path == Path(".tandem/lake")
    assert _spec_of_up(monkeypatch, "--workdir", str(tmp_path / "w")).lake == tmp_path / "w" / "lake"
    assert _spec_of_up(monkeypatch, "--lake", str(tmp_path / "x")).lake == tmp_path / "x"
    monkeypatch.setenv(LAKE_DIR_ENV, str(tmp_path / "env"))
    assert _spec_of_up(monkeypatch).lake == tmp_path / "env" == lake_dir().path


def test_query_and_report_without_flags_read_tandem_ups_lake(make_emitter, make_writer, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    _write_requests(make_emitter, make_writer, tmp_path / ".tandem" / "lake")
    res = runner.invoke(app, ["lake", "query", "SELECT count(*) AS n FROM requests", "--format", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip()) == {"n": 3}
    res = runner.invoke(app, ["lake", "report", "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert "report on 3 requests" in res.output


def test_environment_variable_points_every_reader_at_one_lake(make_emitter, make_writer, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    _write_requests(make_emitter, make_writer, tmp_path / "elsewhere", n=2)
    monkeypatch.setenv(LAKE_DIR_ENV, str(tmp_path / "elsewhere"))
    res = runner.invoke(app, ["lake", "query", "SELECT count(*) AS n FROM requests", "--format", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip()) == {"n": 2}


@pytest.mark.parametrize(
    "argv",
    [
        ["lake", "query", "SELECT 1"],
        ["lake", "report", "--out", "rep"],
        ["lake", "questions", "--run"],
        ["telemetry", "compact", "--redis-url", "redis://127.0.0.1:6379/12"],
    ],
)
def test_a_command_pointed_at_no_lake_says_so_and_fails(argv, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, argv)
    assert res.exit_code == 2, res.output
    assert "no lake at .tandem/lake" in res.stderr and "(from default)" in res.stderr
    assert res.stdout == ""
    res = runner.invoke(app, [*argv, "--lake", str(tmp_path / "typo")])
    assert res.exit_code == 2 and f"no lake at {tmp_path / 'typo'}" in res.stderr
    assert "(from --lake)" in res.stderr
    assert not (tmp_path / "rep").exists() and not (tmp_path / "typo").exists()


def test_a_named_cluster_has_its_own_default_workdir_and_lake(monkeypatch, tmp_path):
    """Two clusters started from one folder keep their logs, lakes and journals apart; ``default`` keeps
    ``.tandem`` as before cluster names, and a lake command under ``TANDEM_CLUSTER`` reads that cluster's."""
    monkeypatch.delenv("TANDEM_CLUSTER", raising=False)
    spec = _spec_of_up(monkeypatch, "--cluster", "staging")
    assert spec.workdir == Path(".tandem/staging") and spec.lake == Path(".tandem/staging/lake")
    assert _spec_of_up(monkeypatch).workdir == Path(".tandem")
    assert _spec_of_up(monkeypatch, "--cluster", "staging", "--workdir", str(tmp_path)).lake == tmp_path / "lake"
    monkeypatch.setenv("TANDEM_CLUSTER", "staging")
    assert lake_dir().path == Path(".tandem/staging/lake") == _spec_of_up(monkeypatch).lake
    res = runner.invoke(app, ["up", "--cluster", "Not_A_Name"])
    assert res.exit_code == 2 and "cluster name" in res.output
