"""Client-message framing for the Responses WebSocket mode (no engines)."""

from __future__ import annotations

import json

from router.edge.codecs.websocket_frames import (
    MAX_MESSAGE_BYTES,
    Bad,
    Cancel,
    Create,
    Prewarm,
    busy_event,
    parse_client_message,
)


def test_create_forces_stream_and_drops_type() -> None:
    got = parse_client_message(json.dumps({"type": "response.create", "model": "m", "input": "hi", "stream": False}))
    assert got == Create({"model": "m", "input": "hi", "stream": True})


def test_create_with_nested_response_object() -> None:
    got = parse_client_message(json.dumps({"type": "response.create", "response": {"model": "m", "input": "x"}}))
    assert got == Create({"model": "m", "input": "x", "stream": True})


def test_generate_false_is_a_prewarm_on_responses_only() -> None:
    # Codex's first message on every socket (its metadata says request_kind: prewarm).
    msg = {"type": "response.create", "model": "m", "input": "x", "store": False, "generate": False}
    assert parse_client_message(json.dumps(msg)) == Prewarm({"model": "m", "input": "x", "store": False})
    assert parse_client_message(json.dumps({**msg, "generate": True})) == Create(
        {"model": "m", "input": "x", "store": False, "generate": True, "stream": True}
    )
    chat = {"model": "m", "messages": [], "generate": False}
    assert isinstance(parse_client_message(json.dumps(chat), api="chat"), Create)


def test_cancel() -> None:
    assert parse_client_message('{"type": "response.cancel"}') == Cancel()


def test_bad_inputs_are_error_events() -> None:
    for text, code in [
        ("not json", "invalid_json"),
        ("[1]", "invalid_json"),
        ('{"type": "session.update"}', "unknown_event"),
        (b"\xff\xfe", "invalid_json"),
        ("x" * (MAX_MESSAGE_BYTES + 1), "message_too_large"),
    ]:
        got = parse_client_message(text)
        assert isinstance(got, Bad), text[:20]
        assert got.event["type"] == "error"
        assert got.event["error"]["code"] == code


def test_busy_event_shape() -> None:
    ev = busy_event()
    assert ev["type"] == "error" and ev["error"]["code"] == "response_in_progress"
