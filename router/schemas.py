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
        """The request as the engine should see it (unset fields left out)."""
        return self.model_dump(exclude_unset=True, exclude_none=True)

    def check_supported(self) -> None:
        if self.n != 1:
            raise InvalidRequest("n > 1 is not supported: send one request per completion", param="n")


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: Any = None


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


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(json_schema_extra=_one_prompt_schema)

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            self.prompt = p[0]
        return self
