"""The router's heap on transparent huge pages (``router.huge_pages``): the environment it restarts
with, what it leaves to the operator, and a real router process that restarts itself once (same pid)
where the kernel offers huge pages, and not at all when told not to."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from router import huge_pages
from router.huge_pages import huge_page_env, thp_mode
from tests.router.test_router_cpu_priority import _router


def test_a_plain_environment_gains_the_allocator_and_the_tunable() -> None:
    env = huge_page_env({"PATH": "/bin"}, "madvise")
    assert env == {"PATH": "/bin", "PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def test_other_tunables_are_kept() -> None:
    env = huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "always")
    assert env is not None
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


@pytest.mark.parametrize(
    "environ",
    [
        {"PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},  # already on them
        {"PYTHONMALLOC": "debug"},  # the operator's allocator
        {"PYTHONMALLOC": "pymalloc"},
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},  # the operator's own value of the tunable
        {"PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=2"},
    ],
)
def test_what_is_set_already_or_chosen_by_the_operator_is_left_alone(environ: dict[str, str]) -> None:
    assert huge_page_env(environ, "madvise") is None


@pytest.mark.parametrize("mode", ["never", None])
def test_nothing_without_transparent_huge_pages(mode: str | None) -> None:
    assert huge_page_env({}, mode) is None


def test_the_kernel_mode_is_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(f) == "madvise"
    assert thp_mode(tmp_path / "missing") is None


@pytest.mark.parametrize(("argv", "restarts"), [(["tandem", "router", "--port", "9"], True), (["pytest", "-q"], False)])
def test_only_the_router_command_replaces_itself(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], restarts: bool
) -> None:
    """``tandem router`` called inside another program (a test's ``CliRunner``) must not replace that
    program: it would start over from its first line, with the environment it had changed by then."""
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(huge_pages.os, "execve", lambda path, args, env: calls.append((path, args, env)))
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(huge_pages.sys, "argv", argv)
    huge_pages.restart_on_huge_pages(True)
    assert len(calls) == restarts
    if restarts:
        path, args, env = calls[0]
        assert path == huge_pages.sys.executable and env["PYTHONMALLOC"] == "malloc"
    huge_pages.restart_on_huge_pages(False)
    assert len(calls) == restarts


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.parametrize("setting", [None, "false"])
def test_a_router_restarts_itself_on_huge_pages_unless_told_not_to(tmp_path: Path, setting: str | None) -> None:
    env = {"TANDEM_ROUTER_HUGE_PAGES": setting} if setting else {}
    proc, url = _router(tmp_path, **env)  # the pid started, answering: a restart keeps it
    try:
        assert httpx.get(f"{url}/health", timeout=10).status_code in (200, 503)
        seen = _environ(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = (tmp_path / "router.log").read_text()
    expected = setting is None and thp_mode() in ("always", "madvise")
    assert (seen.get("PYTHONMALLOC") == "malloc") is expected, seen.get("PYTHONMALLOC")
    assert ("glibc.malloc.hugetlb=1" in seen.get("GLIBC_TUNABLES", "")) is expected
    assert ("restarting on transparent huge pages" in log) is expected, log[-2000:]
