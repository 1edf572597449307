"""``python -m bench.relay_path`` drives the router's real relay code (upstream parser, SSE split, chat
relay, client framing) in process: every chunk must come out framed for the client and traced as a
token, or its per-chunk figure (docs/bench/overhead.md) would time a path that drops work."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

from bench.relay_path import engine_chunk, relay_path

ROOT = Path(__file__).resolve().parents[2]


def test_every_chunk_is_relayed_framed_and_traced() -> None:
    res = asyncio.run(relay_path(50))
    assert res.tokens_traced == 50
    # The id already is the router's, so each payload passes unchanged: the client gets the engine's
    # event bytes, framed as one HTTP chunk each.
    events = [engine_chunk("chatcmpl-relay-path", i).split(b"\r\n")[1] for i in range(50)]
    assert res.client_bytes == sum(len(b"%x\r\n%s\r\n" % (len(e), e)) for e in events)
    assert res.us_per_chunk > 0


def test_the_command_prints_its_figure() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.relay_path", "--chunks", "200"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"router relay path: \d+\.\d\d µs per chunk over 200 chunks", run.stdout), run.stdout
