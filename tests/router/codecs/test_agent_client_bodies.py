"""What Codex CLI and Claude Code send by default decodes (shapes taken from their requests, see
``infra.agent_clients``): Codex's ``namespace`` and ``web_search`` tools beside its function tools,
Claude Code's mid-conversation ``system`` message after the user's prompt."""

from __future__ import annotations

import pytest

from router.edge.codecs import messages, responses
from router.edge.codecs.intake import check_schema
from router.edge.codecs.internal import RequestError, to_chat_body

FN = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}


def test_codex_namespace_tools_join_the_list_and_hosted_tools_are_left_out() -> None:
    body = {
        "model": "m",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
        "tools": [
            FN,
            {"type": "namespace", "name": "multi_agent_v1", "tools": [{**FN, "name": "close_agent"}]},
            {"type": "web_search", "external_web_access": True},
        ],
        "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "conv-1",
    }
    check_schema("responses", body)  # the route's documented schema takes what Codex sends
    req = responses.decode_request(body, {"session-id": "conv-1", "thread-id": "conv-1"})
    assert [t.name for t in req.tools] == ["exec_command", "close_agent"]
    assert [m.role for m in req.messages] == ["system", "user"]
    assert req.hints.session_id == "conv-1" and req.hints.prompt_cache_key == "conv-1"
    with pytest.raises(RequestError, match="tools"):
        responses.decode_request({**body, "tools": [{"type": "mcp", "server_label": "x"}]})


def test_claude_code_mid_conversation_system_message_stays_in_place() -> None:
    body = {
        "model": "m",
        "max_tokens": 32000,
        "system": [{"type": "text", "text": "You are Claude Code."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "say hi"}]},
            {"role": "system", "content": "Available agent types: ..."},
        ],
        "thinking": {"type": "adaptive"},
    }
    check_schema("messages", body)  # the route's documented schema takes what Claude Code sends
    req = messages.decode_request(body, {"x-claude-code-session-id": "s-1"})
    assert [(m.role, m.text) for m in req.messages] == [
        ("system", "You are Claude Code."),
        ("user", "say hi"),
        ("system", "Available agent types: ..."),
    ]
    assert [m["role"] for m in to_chat_body(req)["messages"]] == ["system", "user", "system"]
    assert req.hints.session_id == "s-1"
    with pytest.raises(RequestError, match="role"):
        messages.decode_request({**body, "messages": [{"role": "tool", "content": "x"}]})
