"""Prompts shared by the end-to-end tests: short, code, multi-turn, tool-result-like, and long."""

from __future__ import annotations

_FILE = "\n".join(
    f"def handler_{i}(request, registry):\n"
    f"    # route request {i} to the node with the longest cached prefix\n"
    f"    node = registry.lookup(request.prefix_hash, shard={i % 7})\n"
    f"    return node.submit(request, priority={i % 3})\n"
    for i in range(40)
)

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a concise coding assistant."},
        {"role": "user", "content": "Write a Python function that reverses a string."},
    ],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And what river runs through it?"},
    ],
    [
        {"role": "user", "content": "List three uses of a hash map."},
        {"role": "assistant", "content": "Caching, counting, and indexing."},
        {"role": "user", "content": "Explain the second one with an example."},
    ],
    [
        {"role": "system", "content": "You review code."},
        {"role": "user", "content": f"Here is a module:\n```python\n{_FILE}\n```\nWhat does handler_3 do?"},
    ],
]
LONG_CHAT_INDEX = 4
COMPLETION_PROMPT = "The three primary colors are"
