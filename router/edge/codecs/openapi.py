"""The OpenAPI description of ``POST /v1/responses`` and ``POST /v1/messages`` (plain ASGI routes that
FastAPI cannot see): the request fields the codecs read (``router.edge.codecs.responses`` / ``messages``),
the answer as JSON or as the API's SSE events, and the errors in each API's own shape."""

from __future__ import annotations

from typing import Any

from router.edge.codecs.internal import MAX_INT
from router.edge.codecs.responses import HOSTED_TOOLS

_STR = {"type": "string"}
_NAME = {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[A-Za-z0-9_-]+$"}
_ID = {"type": "string", "minLength": 1, "maxLength": 128}


def _obj(required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props}


def _const(value: str) -> dict[str, Any]:
    return {"type": "string", "enum": [value]}


_TEXT_PART = {
    "anyOf": [
        _obj(["type", "text"], type={"type": "string", "enum": ["input_text", "output_text", "text"]}, text=_STR),
        _obj(["type", "refusal"], type=_const("refusal"), refusal=_STR),
    ]
}
_RESPONSES_ITEM = {
    "anyOf": [
        _obj(
            ["role", "content"],
            type=_const("message"),
            role={"type": "string", "enum": ["user", "assistant", "system", "developer"]},
            content={"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
        ),
        _obj(["type", "call_id", "name"], type=_const("function_call"), call_id=_ID, name=_NAME, arguments=_STR),
        _obj(
            ["type", "call_id", "output"],
            type=_const("function_call_output"),
            call_id=_ID,
            output={"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
        ),
        _obj(["type"], type=_const("reasoning")),  # dropped: the engine gets no hidden reasoning back
    ]
}
_FUNCTION_TOOL = _obj(
    ["type", "name"], type=_const("function"), name=_NAME, description=_STR, parameters={"type": "object"}
)
# Tools OpenAI's servers run (Codex lists web_search by default): accepted, and left out (router.edge.codecs.responses).
_HOSTED_TOOL = _obj(["type"], type={"type": "string", "enum": sorted(HOSTED_TOOLS)})
_NAMESPACE_TOOL = _obj(["type", "tools"], type=_const("namespace"), tools={"type": "array", "items": _FUNCTION_TOOL})
RESPONSES_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": {
            "anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": _RESPONSES_ITEM}]
        },
        "instructions": {"type": ["string", "null"]},
        "previous_response_id": {"type": ["string", "null"]},
        "tools": {"type": "array", "items": {"anyOf": [_FUNCTION_TOOL, _HOSTED_TOOL, _NAMESPACE_TOOL]}},
        "tool_choice": {
            "anyOf": [
                {"type": "string", "enum": ["auto", "none", "required"]},
                _obj(["type", "name"], type=_const("function"), name=_NAME),
            ]
        },
        "parallel_tool_calls": {"type": "boolean"},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_INT},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        # Above 0: the engine refuses 0 (vLLM: "top_p must be in (0, 1]"), so the document does too.
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "stream": {"type": "boolean"},
        "store": {"type": "boolean"},
        "metadata": {"type": "object", "additionalProperties": _STR},
        "truncation": {"type": "string", "enum": ["auto", "disabled"]},
        "prompt_cache_key": _STR,
        "user": _STR,
    },
}
_TEXT_BLOCK = _obj(["type", "text"], type=_const("text"), text=_STR)
_TEXT_OR_BLOCKS = {"anyOf": [_STR, {"type": "array", "items": _TEXT_BLOCK}]}
_USER_BLOCK = {
    "anyOf": [
        _TEXT_BLOCK,
        _obj(["type", "tool_use_id"], type=_const("tool_result"), tool_use_id=_ID, content=_TEXT_OR_BLOCKS),
    ]
}
_ASSISTANT_BLOCK = {
    "anyOf": [
        _TEXT_BLOCK,
        _obj(["type", "id", "name"], type=_const("tool_use"), id=_ID, name=_NAME, input={"type": "object"}),
        _obj(["type"], type={"type": "string", "enum": ["thinking", "redacted_thinking"]}),
    ]
}
MESSAGES_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["model", "max_tokens", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_INT},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    _obj(
                        ["role", "content"],
                        role=_const("user"),
                        content={"anyOf": [_STR, {"type": "array", "items": _USER_BLOCK}]},
                    ),
                    # A mid-conversation system message (Claude Code's agents and skills send one).
                    _obj(["role", "content"], role=_const("system"), content=_TEXT_OR_BLOCKS),
                    _obj(
                        ["role", "content"],
                        role=_const("assistant"),
                        content={"anyOf": [_STR, {"type": "array", "items": _ASSISTANT_BLOCK}]},
                    ),
                ]
            },
        },
        "system": _TEXT_OR_BLOCKS,
        "tools": {
            "type": "array",
            "items": _obj(
                ["name", "input_schema"],
                type=_const("custom"),
                name=_NAME,
                description=_STR,
                input_schema={"type": "object"},
            ),
        },
        "tool_choice": {
            "anyOf": [
                _obj(["type"], type={"type": "string", "enum": ["auto", "any", "none"]}),
                _obj(["type", "name"], type=_const("tool"), name=_NAME),
            ]
        },
        # The engine takes at most 4 stop strings (vLLM's chat request refuses more with a 400).
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},  # as Responses' (above)
        "top_k": {"type": "integer", "minimum": 0, "maximum": MAX_INT},
        "stream": {"type": "boolean"},
        "metadata": {"type": "object"},
        "thinking": {"type": "object"},
    },
}
COUNT_TOKENS_REQUEST: dict[str, Any] = {
    **MESSAGES_REQUEST,
    "required": ["model", "messages"],
    "properties": {k: v for k, v in MESSAGES_REQUEST["properties"].items() if k not in ("max_tokens", "stream")},
}
ANTHROPIC_ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"type": "string", "enum": ["error"]},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": _STR, "message": _STR},
        },
    },
}
_SSE = {
    "schema": {
        "type": "object",
        "required": ["data"],
        "properties": {"event": {"type": "string", "description": "The event's type"}, "data": _STR},
    }
}


def document_agent_routes(schema: dict[str, Any], openai_errors: dict[str, Any]) -> None:
    """Add the two routes to ``schema``; ``openai_errors`` are the chat routes' error answers."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ResponsesRequest"] = RESPONSES_REQUEST
    components["MessagesRequest"] = MESSAGES_REQUEST
    components["AnthropicError"] = ANTHROPIC_ERROR
    components["CountTokensRequest"] = COUNT_TOKENS_REQUEST
    anthropic = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}}
    anthropic_errors = {
        str(code): {"description": desc, **anthropic}
        for code, desc in (
            (400, "Invalid request"),
            (401, "Bad or missing key"),
            (403, "Not allowed for this key"),
            (404, "Unknown model"),
            (413, "Request too large"),
            (422, "A field's value is out of range"),
            (429, "Rate limited"),
            (502, "Upstream error"),
            (529, "Overloaded"),
        )
    }
    count = schema["paths"]["/v1/messages/count_tokens"]["post"]
    count["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CountTokensRequest"}}},
    }
    count["responses"] = {
        "200": {
            "description": "The prompt's tokens",
            "content": {"application/json": {"schema": _obj(["input_tokens"], input_tokens={"type": "integer"})}},
        },
        **anthropic_errors,
    }
    for path, name, summary, errors in (
        (
            "/v1/responses",
            "ResponsesRequest",
            "Create a response (OpenAI Responses API; SSE when stream)",
            openai_errors,
        ),
        (
            "/v1/messages",
            "MessagesRequest",
            "Create a message (Anthropic Messages API; SSE when stream)",
            anthropic_errors,
        ),
    ):
        schema.setdefault("paths", {})[path] = {
            "post": {
                "summary": summary,
                "operationId": name.removesuffix("Request").lower() + "_create",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
                },
                "responses": {
                    "200": {
                        "description": "The answer: JSON, or the API's SSE events",
                        "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": _SSE},
                    },
                    **errors,
                },
            }
        }
