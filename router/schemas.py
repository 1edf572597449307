"""Validation of the OpenAI request bodies the router accepts.

Only what the router itself relies on is typed; every other field (temperature, tools, logprobs, ...)
is kept as given and forwarded to the engine, which validates it in turn, except the fields in
``INTERNAL_FIELDS``: the router sets those for engines, and a client's are dropped at validation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contracts.errors import InvalidRequest

INTERNAL_FIELDS = frozenset({"kv_transfer_params", "request_id", "priority"})
"""Body fields only the router may give an engine. ``kv_transfer_params`` names where a decode pulls KV
from (a client's could point a decode node at a server it controls, or pin blocks); ``request_id``
would let a client choose the engine's id for its request (colliding with another's); ``priority`` is
the engine scheduler's, which the router's own classes (``x-tandem-priority``) decide."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)

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
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            self.prompt = p[0]
        return self
