"""``tandem bench chaos``'s load: ``streams`` closed-loop SSE clients, agent-like (a shared system prompt, a
short question), each waiting the answer's Retry-After (at most 2 s) after a failure, as OpenAI's clients
do; every request's outcome kept for the per-fault and whole-run figures."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from bench.chaos import ChaosConfig


SYSTEM = "You are a coding agent in a Python repository. " + " ".join(
    f"Rule {i}: small functions, clear names, tests that can fail." for i in range(25)
)


@dataclass(slots=True)
class Request:
    start: float
    end: float = 0.0
    outcome: str = "running"
    """ok, status <code>, error event (an SSE error event), cut (connection closed mid-answer),
    refused (no router listening), hung (no byte for hang_s)."""
    response_id: str | None = None
    tokens: int = 0


class Workload:
    """``streams`` threads of closed-loop SSE requests; every request's outcome is kept."""

    def __init__(self, url: str, model: str, cfg: ChaosConfig) -> None:
        self.url, self.model, self.cfg = url, model, cfg
        self.stop = threading.Event()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._worker, args=(n,), daemon=True) for n in range(cfg.streams)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(self.cfg.hang_s + 30)

    def _worker(self, n: int) -> None:
        timeout = httpx.Timeout(connect=10, read=self.cfg.hang_s, write=10, pool=10)
        with httpx.Client(timeout=timeout) as client:
            i = 0
            while not self.stop.is_set():
                i += 1
                req = Request(start=time.monotonic())
                with self._lock:
                    self.requests.append(req)
                retry_after = self._one(client, req, n, i)
                req.end = time.monotonic()
                if req.outcome != "ok":
                    self.stop.wait(min(2.0, retry_after))  # a client's pause before retrying

    def _one(self, client: httpx.Client, req: Request, n: int, i: int) -> float:
        body = {
            "model": self.model,
            "stream": True,
            "max_tokens": self.cfg.max_tokens,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Session {n}, step {i}: what should I check next?"},
            ],
        }
        try:
            with client.stream(
                "POST", f"{self.url}/v1/chat/completions", json=body, headers={"x-session-id": f"chaos-{n}"}
            ) as resp:
                if resp.status_code != 200:
                    req.outcome = f"status {resp.status_code}"
                    resp.read()
                    return float(resp.headers.get("retry-after") or 0.5)
                done = error = False
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        continue
                    with contextlib.suppress(ValueError):
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = True
                        req.response_id = req.response_id or chunk.get("id")
                        req.tokens += sum(
                            1 for c in chunk.get("choices") or [] if (c.get("delta") or {}).get("content")
                        )
                req.outcome = "error event" if error else ("ok" if done else "cut")
        except httpx.TimeoutException:
            req.outcome = "hung"
        except httpx.ConnectError:
            req.outcome = "refused"  # nothing listening (the router is down): never reached a node
        except httpx.HTTPError:
            req.outcome = "cut"
        return 0.5

    def snapshot(self) -> list[Request]:
        with self._lock:
            return list(self.requests)
