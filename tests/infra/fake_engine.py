"""A STAND-IN engine process for supervision tests: answers /health, /metrics (vLLM's metric names) and
/v1/models like a vLLM server, runs no model. What the tests exercise is the node agent around it:
real processes that exit, are killed or stopped, hold ports, and leave helpers behind.

    python -m tests.infra.fake_engine --port P [--helper] [--busy] [--exit-status N]

--helper       also start a helper process in the same process group that listens on P+2 (like
               vLLM's engine core holding a side port), so killing only the leader leaves it behind
--busy         report one running request whose token counters never move (a stalled engine)
--exit-status  exit with this status at once (an engine that cannot start)
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _metrics(busy: bool) -> str:
    return (
        f"vllm:num_requests_running{{model_name=\"fake\"}} {1 if busy else 0}\n"
        "vllm:num_requests_waiting{model_name=\"fake\"} 0\n"
        "vllm:kv_cache_usage_perc{model_name=\"fake\"} 0.0\n"
        "vllm:generation_tokens_total{model_name=\"fake\"} 7\n"
        "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"64\"} 1.0\n"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--helper", action="store_true")
    p.add_argument("--busy", action="store_true")
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
        subprocess.Popen([sys.executable, "-m", "tests.infra.fake_engine", "--port", str(a.port + 2), "--listen-only"])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/health":
                body, ctype = b"", "text/plain"
            elif self.path == "/metrics":
                body, ctype = _metrics(a.busy).encode(), "text/plain; version=0.0.4"
            elif self.path == "/v1/models":
                body = json.dumps({"data": [{"id": "fake", "max_model_len": 512}]}).encode()
                ctype = "application/json"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer.allow_reuse_address = True
    ThreadingHTTPServer(("127.0.0.1", a.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
