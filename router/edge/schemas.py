"""Validation of the OpenAI request bodies the router accepts.

Only what the router itself relies on is typed; every other field (temperature, tools, logprobs, ...)
is kept as given and forwarded to the engine, which validates it in turn, except the fields in
``INTERNAL_FIELDS``: the router sets those for engines, and a client's are dropped at validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, model_validator

from contracts.errors import InvalidRequest

INTERNAL_FIELDS = frozenset({"kv_transfer_params", "request_id", "priority"})
"""Body fields only the router may give an engine. ``kv_transfer_params`` names where a decode pulls KV
from (a client's could point a decode node at a server it controls, or pin blocks); ``request_id``
would let a client choose the engine's id for its request (colliding with another's); ``priority`` is
the engine scheduler's, which the router's own classes (``x-tandem-priority``) decide."""


def _json_integer(value: Any) -> Any:
    """JSON Schema's integer: a number with no fraction. Pydantic's lax mode would also take ``true``
    and ``"5"``, which the OpenAPI document (``type: integer``) says are invalid."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be an integer")
    return value


# (The bound before the validator: after it, pydantic writes ``ge`` into the JSON schema, not ``minimum``.)
JsonInt = Annotated[int, BeforeValidator(_json_integer)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_json_integer)]
TokenId = Annotated[int, Field(ge=0), BeforeValidator(_json_integer)]
"""A token id: an index into the vocabulary (which is the engine's to bound; it refuses ids past it)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    # One completion per request: documented as at most 1, refused above it with a 400 that says why.
    n: JsonInt = Field(default=1, ge=1, json_schema_extra={"maximum": 1})

    @model_validator(mode="before")
    @classmethod
    def _drop_internal(cls, data: Any) -> Any:
        if isinstance(data, dict) and not INTERNAL_FIELDS.isdisjoint(data):
            data = {k: v for k, v in data.items() if k not in INTERNAL_FIELDS}
        return data

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def body(self) -> dict[str, Any]:
        """The request as the engine should see it (unset fields left out). ``stream_options`` only with
        ``stream``: they are a stream's options, and vLLM refuses them on a plain answer (a 400 for a
        request the document calls valid)."""
        body = self.model_dump(exclude_unset=True, exclude_none=True)
        if not self.stream:
            body.pop("stream_options", None)
        return body

    def check_supported(self) -> None:
        if self.n != 1:
            raise InvalidRequest("n > 1 is not supported: send one request per completion", param="n")


ROLES = ("system", "user", "assistant", "tool", "developer", "function")
PART_TYPES = (
    "text",
    "refusal",
    "image_url",
    "input_audio",
    "audio_url",
    "video_url",
    "file",
    "input_image",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "thinking",
)
"""Content part types passed to the engine (OpenAI's, and vLLM's own it parses): a model without the
modality refuses its parts itself. Any other type is the router's 422: the document names text parts
only, so a part of a type nobody knows must be refused whatever the engine would make of it."""
_TEXT_PART_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
}
_CONTENT_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART_SCHEMA}]}


def _message_schema(schema: dict[str, Any]) -> None:
    """What ``Message`` enforces, as the document says it: content a string or a list of parts, null only
    for the assistant (whose turn may be tool calls alone). Other part types (images, audio) reach the
    engine, which serves them or refuses them by its model; the document names the text parts only."""
    props = schema["properties"]
    props["content"] = _CONTENT_SCHEMA
    others = [r for r in ROLES if r != "assistant"]
    schema["anyOf"] = [
        {"properties": {"role": {"type": "string", "enum": others}, "content": _CONTENT_SCHEMA}},
        {
            "properties": {
                "role": {"type": "string", "enum": ["assistant"]},
                "content": {"anyOf": [*_CONTENT_SCHEMA["anyOf"], {"type": "null"}]},
            }
        },
    ]


class Message(BaseModel):
    """A chat message. ``content`` is checked to the shape the engine takes (vLLM refused a tool message
    whose content was ``0`` with a 400 after the router had accepted it, found by schemathesis against a
    real engine): a string, or a list of parts each an object of a ``type`` in ``PART_TYPES`` (a ``text``
    part with a string ``text``); null only for the assistant."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_message_schema)
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: Any = None

    @model_validator(mode="after")
    def _content_shape(self) -> Message:
        c = self.content
        if c is None:
            if self.role != "assistant" and "content" in self.model_fields_set:
                raise ValueError(f"content: a {self.role} message's content is a string or a list of parts, not null")
            return self
        if isinstance(c, str):
            return self
        if not isinstance(c, list):
            raise ValueError("content must be a string or a list of parts")
        for i, part in enumerate(c):
            # (Not a bare string: vLLM takes one in a user message and refuses it in an assistant's.)
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_TYPES:
                raise ValueError(f"content.{i}: a part is an object whose `type` is one of {', '.join(PART_TYPES)}")
            if kind == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"content.{i}: a text part's `text` is a string")
        return self


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _one_prompt_schema(schema: dict[str, Any]) -> None:
    """The OpenAPI document says what ``_one_prompt`` enforces: a list of prompts holds one."""
    for variant in schema.get("anyOf", []):
        if variant.get("type") == "array" and variant.get("items", {}).get("type") != "integer":
            variant["maxItems"] = 1


NonEmptyStr = Annotated[str, Field(min_length=1)]


class CompletionRequest(_Common):
    # Never empty (vLLM refuses an empty prompt with a 400: the document says so, and the router refuses it).
    prompt: (
        NonEmptyStr
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(json_schema_extra=_one_prompt_schema)

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            self.prompt = p[0]
        return self
