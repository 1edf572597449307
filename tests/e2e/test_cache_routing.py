"""Routing keys equal the engine's: on a growing multi-turn agent chat (assistant turns and tool
results appended), the router's predicted routed_cached_tokens equals what the engine that prefilled
reports it reused (usage.prompt_tokens_details.cached_tokens)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from router.edge.app import create_app
from router.kv_index import BlockHasher
from router.settings import RouterSettings
from router.tokenizer import _load, _token_ids
from tests.e2e.conftest import LiveCluster
from tests.support.helpers import wait_for

pytestmark = pytest.mark.e2e

SYSTEM = "You are a coding agent working in a Python repository. " + " ".join(
    f"Rule {i}: keep functions small, name things clearly, test behaviour that can fail." for i in range(40)
)


def test_routed_cached_tokens_equal_engine_cached_tokens(cluster: LiveCluster) -> None:
    settings = RouterSettings(redis_url=cluster.redis_url, policy="cache_aware", telemetry=False)
    with TestClient(create_app(settings)) as client:
        index = client.app.state.index
        node = client.app.state.fleet.nodes[0].info
        tok, hasher = _load(node.model_path), BlockHasher(node.block_size, "sha256_cbor")
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "List the files that define the router."},
        ]
        seen: list[tuple[int, int, int]] = []
        for turn in range(4):
            resp = client.post(
                "/v1/chat/completions",
                headers={"x-session-id": "cache-routing"},
                json={"model": cluster.model, "messages": messages, "max_tokens": 12, "temperature": 0},
            )
            assert resp.status_code == 200, resp.text
            usage = resp.json()["usage"]
            t = usage["tandem"]
            seen.append((t["routed_cached_tokens"], t["engine_cached_tokens"], usage["prompt_tokens"]))
            assert usage["prompt_tokens_details"]["cached_tokens"] == t["engine_cached_tokens"]
            if turn > 0:
                assert t["routed_cached_tokens"] == t["engine_cached_tokens"], seen
                assert t["engine_cached_tokens"] > 0, seen
                assert t["fleet_cached_tokens"] >= t["routed_cached_tokens"]
            # Wait until the engines' KV events for this prompt's full blocks reached the router's index.
            keys = hasher.keys(_token_ids(tok, {"messages": messages}))
            assert wait_for(
                lambda k=keys: max(index.longest_prefix(cluster.model, k).values(), default=0) >= len(k), timeout_s=15
            ), "KV events did not reach the index"
            answer = resp.json()["choices"][0]["message"]["content"]
            # The next turn: the answer, a tool result, and a new question, as an agent would send.
            messages = [
                *messages,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"Tool output #{turn}:\n" + "router/edge/app.py\n" * (20 + turn)},
            ]
