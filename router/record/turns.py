"""After a request: settle its token reservation and record its chat turn in the session store.

Runs as a background task once the answer has been delivered, so neither Redis round trip nor the
session read ever sits on the fast path. A failure here is logged and counted, never surfaced: the
client already has its answer. The settle (Redis) and the turn (the session writer, PostgreSQL) are
separate steps: Redis failing at a stream's end costs a token-bucket correction, never the turn.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from contracts.errors import TandemError
from router.admission.context import AdmissionContext
from router.admission.ratelimit import Admission
from router.background import TaskSet
from router.planning.orchestrator import RequestTrace
from router.sessions.models import Message, ToolCall, Turn, Usage, conversation, new_messages

log = logging.getLogger("tandem.router.turns")


class TurnRecorder:
    def __init__(self, ctx: AdmissionContext) -> None:
        self.ctx = ctx
        self._tasks = TaskSet()

    def after(self, trace: RequestTrace, admission: Admission | None, messages: list[dict[str, Any]] | None) -> None:
        if admission is None:
            return
        # Most requests have neither a token charge to settle nor a session turn to store: no task then.
        if (
            admission.tokens_charged
            and not admission.settled
            or (messages is not None and trace.session_id and trace.status == "ok")
        ):
            self._tasks.spawn(self._after(trace, admission, messages))

    async def _after(
        self, trace: RequestTrace, admission: Admission | None, messages: list[dict[str, Any]] | None
    ) -> None:
        if admission is None:
            return
        # Two jobs, apart: a Redis that fails the settle (its token bucket) must not lose the turn, which
        # the session writer puts in the store (PostgreSQL) whether or not Redis answers.
        try:
            await self.ctx.gate.settle(admission, trace.completion_tokens or 0)
        except TandemError as exc:
            log.warning("settling the tokens of %s failed: %s", trace.request_id, exc)
        if messages is not None and trace.session_id and trace.status == "ok":
            try:
                self._record(trace, admission.tenant.tenant_id, messages, await self._history(trace, admission))
            except (TandemError, msgspec.ValidationError) as exc:
                self.ctx.sessions.stats.failed += 1
                log.warning("recording the turn of %s failed: %s", trace.request_id, exc)

    async def _history(self, trace: RequestTrace, admission: Admission) -> list[Message]:
        assert trace.session_id is not None
        return conversation(await self.ctx.sessions.get_history(admission.tenant.tenant_id, trace.session_id))

    def _record(self, trace: RequestTrace, tenant: str, messages: list[dict[str, Any]], history: list[Message]) -> None:
        assert trace.session_id is not None
        request_messages = msgspec.convert(messages, list[Message], strict=False)
        calls = [
            {"id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(trace.tool_calls.items())
        ]
        response = Message(
            role="assistant",
            content="".join(trace.content) or None,
            tool_calls=msgspec.convert(calls, list[ToolCall]) or None,
        )
        self.ctx.sessions.record_turn(
            Turn(
                turn_id=trace.request_id,
                session_id=trace.session_id,
                tenant_id=tenant,
                created_at=trace.finish or time.time(),
                messages=new_messages(history, request_messages),
                response=response,
                model=trace.model,
                usage=Usage(
                    prompt_tokens=trace.prompt_tokens or 0,
                    completion_tokens=trace.completion_tokens or 0,
                    total_tokens=(trace.prompt_tokens or 0) + (trace.completion_tokens or 0),
                ),
            )
        )

    async def drain(self) -> None:
        await self._tasks.drain()
