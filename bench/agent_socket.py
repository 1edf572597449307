"""Agent sessions chained by ``previous_response_id``, over SSE and over one WebSocket each: the two
``tandem bench agents`` arms that compare the transports on the same sessions (issue 39).

A chained session sends its first turn whole (instructions, tools, the history so far); every later
turn only what is new since the previous answer (the workload's next user message: the tool's output),
naming the previous response. The model's own answers, not the workload's scripted ones, are then the
history, on both arms alike (greedy), so the engines see the same prompts whichever way they come::

    tandem_responses-chain   POST /v1/responses per turn (SSE), ``store: true``: the chain is read
                             back from the router's response store
    tandem_responses-ws      one socket per session (``GET /v1/responses`` upgraded), a
                             ``response.create`` per turn, ``store: false``: the socket holds its
                             last response, as OpenAI's WebSocket mode does

``socket_turn`` times a turn on a socket as ``bench.agent_apis.one_turn`` times one over SSE: from the
message sent to the first text delta, the gaps between deltas, usage from the terminal event.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import websockets

from bench.agent_apis import Item, Usage, answered, read_event, responses_body
from bench.loadgen import RequestResult, TokenClock

CHAINED = ("responses-chain", "responses-ws")


def chained_body(
    model: str, system: str, items: list[Item], new: list[Item], previous: str | None, max_tokens: int, store: bool
) -> dict[str, Any]:
    """A chained turn: the whole first turn, or only ``new`` on top of ``previous``."""
    body = responses_body(model, system, items if previous is None else new, max_tokens)
    body["store"] = store
    if previous is not None:
        del body["instructions"]  # a chain keeps its first turn's (its stored conversation holds them)
        body["previous_response_id"] = previous
    return body


def new_items(turn: list[dict[str, str]]) -> list[Item]:
    """What a scripted turn adds after the previous answer: its trailing user message (a tool's output)."""
    return [Item("user", turn[-1]["content"])]


async def socket_turn(ws: websockets.ClientConnection, body: dict[str, Any]) -> tuple[RequestResult, str | None]:
    """One ``response.create`` on ``ws`` and its events to the end: (the timing, the response id)."""
    message = {"type": "response.create", **{k: v for k, v in body.items() if k != "stream"}}
    clock = TokenClock()
    usage = Usage()
    response_id = None
    try:
        await ws.send(json.dumps(message))
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 600))
            text, error = read_event("responses", event, usage)
            if error is not None:
                return RequestResult(ok=False, error=error), None
            if text:
                clock.tick()
            if event.get("type") in ("response.completed", "response.incomplete"):
                response_id = event["response"]["id"]
                break
    except (websockets.WebSocketException, TimeoutError, json.JSONDecodeError) as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}"), None
    result = answered(clock, usage)
    return result, response_id if result.ok else None
