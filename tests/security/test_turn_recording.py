"""No silent loss of a session's turn (issue 35, item 5): when Redis dies at a stream's end the token
settle fails, and the turn is still written to PostgreSQL (the settle and the turn are separate steps
of ``router.record.turns``). A real redis-server (the embedded binary) is killed; real PostgreSQL."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen

import pytest

from infra.redis_server import start_embedded
from router.admission.context import AdmissionContext, AdmissionSettings
from router.planning.orchestrator import RequestTrace
from router.record.turns import TurnRecorder


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[tuple[Popen[bytes], int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = start_embedded(port, tmp_path / "redis")
    yield proc, port
    proc.kill()
    proc.wait()


async def test_redis_killed_at_a_streams_end_leaves_the_turn_in_postgresql(
    redis_proc: tuple[Popen[bytes], int], pg_url: str
) -> None:
    proc, port = redis_proc
    ctx = await AdmissionContext.create(
        AdmissionSettings(
            redis_url=f"redis://127.0.0.1:{port}/0",
            database_url=pg_url,
            region="a",
            region_cache_urls={},
            redis_socket_timeout_s=0.5,
            redis_connect_timeout_s=0.5,
        )  # type: ignore[arg-type]
    )
    try:
        admission = await ctx.gate.admit(None, prompt_tokens=12, max_tokens=8)
        assert admission.tokens_charged and not admission.settled  # a settle is owed at the end
        session_id = f"s-{uuid.uuid4().hex[:12]}"
        trace = RequestTrace(
            request_id=f"chatcmpl-{uuid.uuid4().hex[:12]}",
            kind="chat",
            model="m",
            session_id=session_id,
            tenant_id=admission.tenant.tenant_id,
            prompt_tokens=12,
            completion_tokens=3,
            content=["the ", "answer"],
        )
        proc.kill()  # Redis dies as the stream ends
        proc.wait()
        recorder = TurnRecorder(ctx)
        recorder.after(trace, admission, [{"role": "user", "content": "the question"}])
        await recorder.drain()
        end = time.monotonic() + 15
        while not (turns := await ctx.sessions.read_store(admission.tenant.tenant_id, session_id)):
            assert time.monotonic() < end, f"the turn never reached PostgreSQL ({ctx.sessions.stats})"
            await asyncio.sleep(0.05)
        [turn] = turns
        assert turn.turn_id == trace.request_id
        assert [m.content for m in turn.messages] == ["the question"]
        assert turn.response.content == "the answer"
    finally:
        await ctx.close()
