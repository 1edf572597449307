"""`OutputLines.until`, which every `tandem up` fixture waits on: a child that closes its output
without the awaited line ends the wait then, with its exit status and last lines, not at the deadline
(a cluster that gave up during start-up once held a CI run for the whole 900 s)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.support.helpers import OutputLines


def _child(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_the_awaited_line_is_returned() -> None:
    out = OutputLines(_child("print('starting'); print('READY http://x', flush=True); import time; time.sleep(30)"))
    try:
        assert out.until("READY ", 60) == "READY http://x\n"
        assert out.seen == ["starting\n", "READY http://x\n"]
    finally:
        out.proc.kill()
        out.proc.wait()


def test_a_child_that_exits_without_it_ends_the_wait_with_its_status_and_output() -> None:
    out = OutputLines(_child("print('error: node died'); print('stopping cluster…'); raise SystemExit(3)"))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)closed its output \(exit 3\).*error: node died.*stopping cluster"):
        out.until("READY ", 600, what="tandem up")
    assert time.monotonic() - started < 60
    with pytest.raises(RuntimeError, match="closed its output"):
        out.until("READY ", 600)  # asked again: the end is still seen, no wait
