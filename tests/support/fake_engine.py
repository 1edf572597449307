"""A STAND-IN engine process for supervision tests: answers /health, /metrics (vLLM's metric names) and
/v1/models like a vLLM server, and chat completions like the benchmark's stand-in; runs no model.
What the tests exercise is the node agent around it: real processes that exit, are killed or
stopped, hold ports, and leave helpers behind.

    python -m tests.support.fake_engine --port P [--helper] [--busy] [--exit-status N]

--helper       also start a helper process in the same process group that listens on P+2 (like
               vLLM's engine core holding a side port), so killing only the leader leaves it behind
--busy         report one running request whose token counters never move (a stalled engine)
--burn         with --busy: also keep a core busy (an engine in one long prefill step, not a deadlock)
--busy-until F report one running request and one KV lease until file F exists (a node draining)
--pulling      report one waiting request and one KV pull under way, no counter moving, no CPU used (a
               decode node waiting for a long prefill on another node)
--exit-status  exit with this status at once (an engine that cannot start)
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def _metrics(busy: bool, leases: int = 0, pulling: bool = False) -> str:
    return (
        f'vllm:num_requests_running{{model_name="fake"}} {1 if busy else 0}\n'
        f'vllm:num_requests_waiting{{model_name="fake"}} {1 if pulling else 0}\n'
        f'tandem_kv_pulls_active{{engine="0",model_name="fake"}} {1.0 if pulling else 0.0}\n'
        'vllm:kv_cache_usage_perc{model_name="fake"} 0.0\n'
        'vllm:generation_tokens_total{model_name="fake"} 7\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="64"} 1.0\n'
        f'tandem_kv_leases_active{{engine="0",model_name="fake"}} {float(leases)}\n'
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--helper", action="store_true")
    p.add_argument("--busy", action="store_true")
    p.add_argument("--busy-until", default=None)
    p.add_argument("--pulling", action="store_true", help="one request waiting on a KV pull, no progress")
    p.add_argument("--burn", action="store_true", help="with --busy: also use a core (a long prefill step)")
    p.add_argument("--exit-status", type=int, default=None)
    p.add_argument("--listen-only", action="store_true", help="(internal) the helper: hold the port, sleep")
    a = p.parse_args()
    if a.exit_status is not None:
        sys.exit(a.exit_status)
    if a.listen_only:
        sock = socket.socket()
        sock.bind(("127.0.0.1", a.port))
        sock.listen()
        while True:
            time.sleep(3600)
    if a.helper:  # same process group: no new session
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.fake_engine", "--port", str(a.port + 2), "--listen-only"]
        )

    # The router-facing part (chat and completions, streamed or not) is the benchmark's stand-in;
    # this adds what a node agent reads from an engine.
    import uvicorn
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    from bench.standin_engine import StandInEngine

    if a.burn:
        import threading

        def burn() -> None:
            while True:  # a forward pass that takes long: CPU used, no counter moves
                sum(i * i for i in range(10_000))

        threading.Thread(target=burn, daemon=True).start()

    def draining() -> bool:
        return a.busy_until is not None and not os.path.exists(a.busy_until)

    app = StandInEngine().app
    app.router.routes += [
        Route(
            "/metrics",
            lambda _: PlainTextResponse(_metrics(a.busy or draining(), int(draining()), a.pulling)),
            methods=["GET"],
        ),
        Route("/v1/models", lambda _: JSONResponse({"data": [{"id": "fake", "max_model_len": 512}]}), methods=["GET"]),
    ]
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
