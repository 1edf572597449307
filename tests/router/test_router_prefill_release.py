"""The router takes a streamed request's prompt tokens off its node's queue (``cache_aware``'s load
term) when the stream's first event arrives, not when the answer ends: a node that streams a long answer
has no prompt work left for it. Until 2026-12-04 the tokens stayed until the end, and the node looked
busy with prefills it had done.

The real router app in this process over a STAND-IN engine (``bench.standin_engine``) registered in the
real Redis registry; the router tokenizes the prompt itself (``tokenize="always"``), so the queue holds
its real token count."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import httpx

from bench.standin_engine import ServerThread, StandInEngine
from contracts.registry import NodeInfo, Role
from node_agent.model import default_model_dir
from tests.support.helpers import in_process_router, wait_for
from tests.support.standin_cluster import REDIS_URL, deregister_nodes, register_nodes


async def test_the_queue_is_released_at_the_first_event_while_the_answer_streams_on(tmp_path: Path) -> None:
    model = f"release-{uuid.uuid4().hex[:8]}"
    engine = StandInEngine(stream_tokens=40, token_interval_s=0.2)
    with ServerThread(engine.app) as engine_url:
        node = NodeInfo(
            node_id=f"n-{model}",
            role=Role.BOTH,
            model=model,
            url=engine_url,
            block_size=16,
            max_model_len=4096,
            kv_connector="none",
            model_path=str(default_model_dir()),
        )
        await register_nodes([node])
        app, server, url = in_process_router(REDIS_URL, tmp_path, f"test-{model}:", tokenize="always", telemetry=False)
        policy = app.services.orchestrator.policy

        def queued() -> dict[str, int]:
            return dict(policy._queued)  # a copy, read from the test's thread

        try:
            engine.close_gate()  # the engine holds the request: its prefill has not "finished"
            prompt = "a prompt of some tokens " * 20
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "stream": True}
            first, done = threading.Event(), threading.Event()
            lines: list[str] = []

            def client() -> None:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            first.set()
                        lines.append(line)
                done.set()

            t = threading.Thread(target=client, daemon=True)
            t.start()
            assert wait_for(lambda: len(engine.bodies()) == 1, 30)
            held = queued()
            assert list(held) == [node.node_id] and held[node.node_id] > 100, held  # its prompt, tokenized

            engine.open_gate()
            assert first.wait(30)
            # The answer is still streaming (40 tokens, 200 ms apart), and the queue is empty already.
            assert wait_for(lambda: not queued(), 3), queued()
            assert engine.streams_open == 1 and not done.is_set()
            t.join(60)
            assert done.is_set() and "data: [DONE]" in lines and not queued()
        finally:
            engine.open_gate()
            server.__exit__(None, None, None)
            await deregister_nodes([node.node_id])
