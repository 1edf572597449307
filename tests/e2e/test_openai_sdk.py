"""The official OpenAI SDK against the router: streamed and non-streamed answers agree."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import LiveCluster
from tests.e2e.prompts import CHATS, COMPLETION_PROMPT

pytestmark = pytest.mark.e2e


@pytest.fixture
def sdk(cluster: LiveCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_chat_stream_equals_non_stream(sdk: openai.OpenAI, cluster: LiveCluster) -> None:
    args = dict(model=cluster.model, messages=CHATS[2], max_tokens=20, temperature=0)
    full = sdk.chat.completions.create(**args)
    chunks = list(sdk.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content != ""
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_without_include_usage_sends_no_usage(sdk: openai.OpenAI, cluster: LiveCluster) -> None:
    chunks = list(
        sdk.chat.completions.create(model=cluster.model, messages=CHATS[0], max_tokens=5, temperature=0, stream=True)
    )
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_completion_stream_equals_non_stream(sdk: openai.OpenAI, cluster: LiveCluster) -> None:
    args = dict(model=cluster.model, prompt=COMPLETION_PROMPT, max_tokens=16, temperature=0)
    full = sdk.completions.create(**args)
    text = "".join(c.choices[0].text for c in sdk.completions.create(**args, stream=True) if c.choices)
    assert text == full.choices[0].text != ""


def test_models_lists_the_served_model(sdk: openai.OpenAI, cluster: LiveCluster) -> None:
    assert [m.id for m in sdk.models.list()] == [cluster.model]
