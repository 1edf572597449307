"""The router's prompt rendering with the real default model's tokenizer and chat template."""

from __future__ import annotations

import asyncio

import pytest

from contracts.errors import InvalidRequest
from contracts.registry import NodeInfo, Role
from node_agent.model import default_model_dir
from router.tokenizer import PromptTokenizer

NODE = NodeInfo(
    node_id="n",
    role=Role.BOTH,
    model="m",
    url="u",
    block_size=16,
    max_model_len=8192,
    kv_connector="none",
    model_path=str(default_model_dir()),
)


def _ids(body: dict) -> list[int] | None:
    return asyncio.run(PromptTokenizer().token_ids(NODE, body))


def test_tool_call_turns_without_content_render() -> None:
    base = [{"role": "user", "content": "Open the README."}]
    with_tools = [
        *base,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "README"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "# Tandem"},
    ]
    short, long = _ids({"messages": base}), _ids({"messages": with_tools})
    assert short and long and len(long) > len(short)
    assert long[: len(short) - 3] == short[: len(short) - 3]  # same prefix up to the generation prompt


def test_completion_prompts_and_token_lists() -> None:
    assert _ids({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert len(_ids({"prompt": "hello world"}) or []) >= 2


def test_unrenderable_messages_are_the_clients_error_never_a_zero_count() -> None:
    with pytest.raises(InvalidRequest) as info:
        _ids({"messages": "not a list"})
    assert info.value.code == "invalid_prompt"


def test_template_arguments_follow_vllm_and_kwargs_override_them() -> None:
    chat = [{"role": "user", "content": "hello"}]
    with_prompt = _ids({"messages": chat})
    assert _ids({"messages": chat, "chat_template_kwargs": {"add_generation_prompt": True}}) == with_prompt
    without = _ids({"messages": chat, "add_generation_prompt": False})
    assert without and with_prompt and len(without) < len(with_prompt)
    assert _ids({"messages": chat, "chat_template_kwargs": {"add_generation_prompt": False}}) == without


def test_the_fast_path_equals_transformers_own_tokenization() -> None:
    """The router encodes the rendered chat with the Rust tokenizer directly; the ids must be exactly
    those of apply_chat_template(tokenize=True), which is what vLLM computes."""
    from collections.abc import Mapping

    from router.tokenizer import _load

    tok = _load(str(default_model_dir()))
    chats = [
        [{"role": "user", "content": "hello"}],
        [
            {"role": "system", "content": "You are terse.\n\n  Tabs\there."},
            {"role": "user", "content": "def f(x):\n    return x  # ünïcödé ✓ 漢字"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "<|im_start|> is text here"},
        ],
    ]
    for messages in chats:
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if isinstance(want, Mapping) else want)
        assert _ids({"messages": messages}) == want


def test_text_content_parts_render_like_a_string() -> None:
    """OpenAI's content-part form (what `vllm bench serve` and SDK users send) is tokenized as vLLM does:
    text parts joined by newlines. It used to fail rendering, and since rendering errors are 400s,
    every such request was refused."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    assert _ids({"messages": parts}) == _ids({"messages": [{"role": "user", "content": "hello\nthere"}]})


def test_a_session_prompt_encoded_from_its_kept_prefix_equals_the_whole_encoding() -> None:
    """A socket's turns (``PrefixTokens``): each prompt repeats the last one and adds an answer and a new
    message, with text that would merge across a naive cut (no newline, spaces, unicode, a special
    token's text typed by the user); each is encoded from the kept prefix and equals the whole encoding.
    A prompt that does not repeat the last one (an edited history) is encoded whole."""
    from router.tokenizer import SESSION_TOKENS, PrefixTokens

    session, tokenizer = PrefixTokens(), PromptTokenizer()  # one tokenizer, as a router holds one

    def _ids(body: dict) -> list[int] | None:
        return asyncio.run(tokenizer.token_ids(NODE, body))

    token = SESSION_TOKENS.set(session)
    try:
        messages: list[dict[str, str]] = [{"role": "system", "content": "You are a coding agent."}]
        additions = [
            ("user", "Read README.md"),
            ("assistant", "Calling read_file(README.md)"),
            ("user", "Output of read_file:\n# Tandem  \n\tP/D  ünïcödé 漢字"),
            ("assistant", "It says Tandem.<|im_end|> typed"),
            ("user", "and?"),
        ]
        for i, (role, text) in enumerate(additions):
            messages.append({"role": role, "content": text})
            if role != "user":
                continue
            got = _ids({"messages": messages})
            SESSION_TOKENS.set(None)
            want = _ids({"messages": messages})
            SESSION_TOKENS.set(session)
            assert got == want, f"turn {i}"
        assert session.hits >= 2
        hits = session.hits
        edited = [{"role": "system", "content": "Another agent."}, *messages[1:]]
        SESSION_TOKENS.set(None)
        want = _ids({"messages": edited})
        SESSION_TOKENS.set(session)
        assert _ids({"messages": edited}) == want and session.hits == hits
    finally:
        SESSION_TOKENS.reset(token)


def test_tool_call_arguments_count_toward_rendering_off_the_loop() -> None:
    """A megabyte of tool-call arguments beside empty content is a long prompt for a template that writes
    calls out: rendered in a thread, never on the event loop (issue 35; they were not counted)."""
    from router.tokenizer import INLINE_CHARS, _prompt_chars

    call = {"id": "c1", "type": "function", "function": {"name": "write", "arguments": "x" * 1_000_000}}
    body = {"messages": [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "user", "content": "go"}]}
    assert _prompt_chars(body) > 1_000_000 > INLINE_CHARS
    assert _prompt_chars({"messages": [{"role": "user", "content": "go"}]}) <= INLINE_CHARS
