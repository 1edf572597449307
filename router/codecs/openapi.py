"""The OpenAPI description of ``POST /v1/responses`` and ``POST /v1/messages`` (plain ASGI routes that
FastAPI cannot see): the request fields the codecs read (``router.codecs.responses`` / ``messages``),
the answer as JSON or as the API's SSE events, and the errors in each API's own shape."""

from __future__ import annotations

from typing import Any

_STR = {"type": "string"}
_TEXT_OR_PARTS = {"anyOf": [_STR, {"type": "array", "items": {"type": "object"}}]}
_TOOL_FN = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "description": _STR,
        "parameters": {"type": "object"},
    },
}
RESPONSES_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "object"}},
            ]
        },
        "instructions": {"type": ["string", "null"]},
        "previous_response_id": {"type": ["string", "null"]},
        "tools": {"type": "array", "items": _TOOL_FN},
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["auto", "none", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": {"type": "boolean"},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "stream": {"type": "boolean"},
        "store": {"type": "boolean"},
        "metadata": {"type": "object", "additionalProperties": _STR},
        "truncation": {"type": "string", "enum": ["auto", "disabled"]},
        "prompt_cache_key": _STR,
        "user": _STR,
    },
}
MESSAGES_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["model", "max_tokens", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "max_tokens": {"type": "integer", "minimum": 1},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"type": "string", "enum": ["user", "assistant"]}, "content": _TEXT_OR_PARTS},
            },
        },
        "system": _TEXT_OR_PARTS,
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "input_schema"],
                "properties": {"name": _STR, "description": _STR, "input_schema": {"type": "object"}},
            },
        },
        "tool_choice": {"type": "object"},
        "stop_sequences": {"type": "array", "items": _STR},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "stream": {"type": "boolean"},
        "metadata": {"type": "object"},
        "thinking": {"type": "object"},
    },
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
    anthropic = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}}
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
            {
                str(code): {"description": desc, **anthropic}
                for code, desc in (
                    (400, "Invalid request"),
                    (401, "Bad or missing key"),
                    (404, "Unknown model"),
                    (413, "Request too large"),
                    (429, "Rate limited"),
                    (502, "Upstream error"),
                    (529, "Overloaded"),
                )
            },
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
