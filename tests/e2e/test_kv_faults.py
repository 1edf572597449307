"""Fault injection on a real P/D cluster with our connector: router, prefill and decode nodes as their own
processes, KV over ZeroMQ tcp with checksums, faults armed on the prefill node's block server over its
own socket (TANDEM_KV_FAULTS=1), nodes killed with SIGKILL.

After every fault: the surviving nodes hold no lease and no KV block (their free-block counts are back
at baseline), no request outlives its deadline, and the client got the right answer (retried or
recomputed) or an OpenAI-format error.

The cluster is this module's own (the session cluster must not lose nodes): one prefill and one decode
node on small KV caches (20 blocks of 128 tokens, 2k context) so that one long request fills the decode
node, and two routers over them: one that sends pairs sequentially (prefill, then a whole pull: the
faults below that name no mode) and one that sends them layer-wise (``router.planning.layerwise``: the tests
named so). The two kill tests run last, in this order; the second starts a fresh decode node.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
import redis
import zmq

from contracts.secret import engine_auth_headers, load_cluster_secret
from kv_transfer import wire
from tests.e2e.conftest import engine_metric
from tests.support.helpers import wait_for
from tests.support.layerwise import layerwise_chat, prefill_params, start_decode_leg

pytestmark = pytest.mark.e2e

REDIS_URL = os.environ.get("TANDEM_TEST_REDIS_FAULTS", "redis://127.0.0.1:6379/11")
ROUTER_PORT, ROUTER_LW_PORT = 18390, 18391
P_PORT, D_PORT, D2_PORT = 18400, 18410, 18420
LEASE_S, TRANSFER_TIMEOUT_S = 30.0, 4.0
DEADLINE_S = 300.0
"""What any request may take here, compute included (a 2k-token float32 prefill on one shared core);
the tests that are about hangs assert tighter bounds themselves."""
NODE_ENV = {
    "TANDEM_KV_FAULTS": "1",
    "TANDEM_NODE_KV_TRANSPORT": "tcp",
    "TANDEM_NODE_KV_LEASE_S": str(LEASE_S),
    "TANDEM_NODE_KV_TRANSFER_TIMEOUT_S": str(TRANSFER_TIMEOUT_S),
    "PYTHONUNBUFFERED": "1",
}
PD = {"x-tandem-route": "disaggregated"}


@dataclass
class FaultCluster:
    workdir: Path
    model: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{ROUTER_PORT}"

    @property
    def lw_url(self) -> str:
        return f"http://127.0.0.1:{ROUTER_LW_PORT}"

    def start(self, name: str, args: list[str]) -> None:
        log = (self.workdir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "tandem", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **NODE_ENV},
        )

    def start_node(self, name: str, role: str, port: int, cores: str) -> None:
        self.start(
            name,
            [
                "node",
                "--role",
                role,
                "--port",
                str(port),
                "--node-id",
                f"kvf-{name}",
                "--redis-url",
                REDIS_URL,
                "--dtype",
                "float32",
                "--cores",
                cores,
                "--max-model-len",
                "2048",
                "--engine-arg=--num-gpu-blocks-override=20",
                # prefills of several chunks: a layer-wise pull waits through the first ones
                "--engine-arg=--max-num-batched-tokens=256",
                "--log-dir",
                str(self.workdir),
            ],
        )

    def nodes(self, url: str | None = None) -> dict[str, str]:
        """Live nodes as the router sees them: node id → role."""
        try:
            nodes = httpx.get(f"{url or self.url}/cluster", timeout=5).json().get("nodes", [])
        except httpx.HTTPError:
            return {}
        return {n["node_id"]: n["role"] for n in nodes}

    def roles(self, url: str | None = None) -> list[str]:
        return sorted(self.nodes(url).values())

    def kill(self, name: str) -> None:
        """SIGKILL a node agent and every process under it (its engine): no clean shutdown."""
        root = psutil.Process(self.procs[name].pid)
        victims = [*root.children(recursive=True), root]
        for p in victims:
            p.kill()
        psutil.wait_procs(victims, timeout=30)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def fc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    redis.Redis.from_url(REDIS_URL).flushdb()
    c = FaultCluster(tmp_path_factory.mktemp("kv-faults"))
    try:
        c.start("router", ["router", "--port", str(ROUTER_PORT), "--redis-url", REDIS_URL, "--no-layerwise"])
        c.start("router-lw", ["router", "--port", str(ROUTER_LW_PORT), "--redis-url", REDIS_URL, "--layerwise"])
        c.start_node("p", "prefill", P_PORT, "0")
        c.start_node("d", "decode", D_PORT, "1")
        assert wait_for(lambda: c.roles() == ["decode", "prefill"], timeout_s=900), c.log("p") + c.log("d")
        assert wait_for(lambda: c.roles(c.lw_url) == ["decode", "prefill"], timeout_s=60), c.log("router-lw")
        c.model = httpx.get(f"{c.url}/v1/models").json()["data"][0]["id"]
        yield c
    finally:
        c.stop()


# -- helpers -----------------------------------------------------------------------------------------------
def node_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def arm(port: int, kind: str, seconds: float = 0.0) -> None:
    """Arm one fault on the prefill node's block server (node port + 3), signed with the cluster secret
    the nodes use (this user's default one, or TANDEM_CLUSTER_SECRET when the environment sets it)."""
    codec = wire.Codec(load_cluster_secret(loopback_only=True))
    with zmq.Context.instance().socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port + 3}")
        s.send(codec.encode(wire.Fault(kind, seconds)))
        assert s.poll(5000), "block server did not answer"
        assert codec.decode(s.recv()) == wire.Ack(True), "faults are not enabled on that node"


def metric(port: int, name: str, **labels: str) -> float:
    return engine_metric(node_url(port), name, **labels)


def at_baseline(port: int) -> bool:
    """No KV block in use and no lease held on this node."""
    return (
        metric(port, "vllm:kv_cache_usage_perc") == 0
        and metric(port, "tandem_kv_leases_active") == 0
        and metric(port, "vllm:num_requests_running") == 0
        and metric(port, "vllm:num_requests_waiting") == 0
    )


def prompt(n_words: int, tag: str) -> list[dict[str, str]]:
    words = " ".join(f"{tag}{i % 97}" for i in range(n_words))
    return [{"role": "user", "content": f"Summarise these identifiers in one line: {words}"}]


def chat(
    fc: FaultCluster,
    messages: list[dict[str, str]],
    headers: dict[str, str] | None = None,
    max_tokens: int = 8,
    url: str | None = None,
) -> httpx.Response:
    body = {"model": fc.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url or fc.url}/v1/chat/completions", json=body, headers=headers or {}, timeout=DEADLINE_S)


def text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def reference(fc: FaultCluster, messages: list[dict[str, str]], max_tokens: int = 8) -> str:
    """The same prompt served whole by the prefill node's engine, no transfer. Asked of the prefill node
    (not the decode node) so that the decode node's cache stays cold and the faulted transfer moves
    every block of the prompt."""
    body = {"model": fc.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    url, headers = f"{node_url(P_PORT)}/v1/chat/completions", engine_auth_headers(loopback_only=True)
    return text(httpx.post(url, json=body, headers=headers, timeout=DEADLINE_S))


def outcome(port: int, name: str) -> float:
    return metric(port, "tandem_kv_lease_outcomes_total", outcome=name)


class Background:
    """A request in a thread, for tests that act on the cluster while it is in flight."""

    def __init__(self, fn) -> None:  # noqa: ANN001
        self.result: httpx.Response | BaseException | None = None
        self.elapsed = 0.0
        self._t = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._t.start()

    def _run(self, fn) -> None:  # noqa: ANN001
        t0 = time.monotonic()
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.result = exc
        self.elapsed = time.monotonic() - t0

    def join(self) -> httpx.Response:
        self._t.join(DEADLINE_S + 30)
        assert not self._t.is_alive(), "request hung past its deadline"
        assert isinstance(self.result, httpx.Response), repr(self.result)
        return self.result


# -- the faults --------------------------------------------------------------------------------------------
def test_happy_path_ends_every_lease_done(fc: FaultCluster) -> None:
    msgs = prompt(300, "ok")
    want = reference(fc, msgs)
    done = outcome(P_PORT, "done")
    assert text(chat(fc, msgs, PD)) == want
    assert wait_for(lambda: outcome(P_PORT, "done") == done + 1, timeout_s=30)
    assert metric(D_PORT, "tandem_kv_transfer_bytes_total") > 0
    assert wait_for(lambda: at_baseline(P_PORT) and at_baseline(D_PORT), timeout_s=30)


def test_corrupted_frame_is_caught_and_the_decode_node_recomputes(fc: FaultCluster) -> None:
    msgs = prompt(300, "crc")
    want = reference(fc, msgs)
    failed, failures = outcome(P_PORT, "failed"), metric(D_PORT, "tandem_kv_transfer_failures_total")
    arm(P_PORT, "corrupt")
    assert text(chat(fc, msgs, PD)) == want
    assert wait_for(lambda: outcome(P_PORT, "failed") == failed + 1, timeout_s=30)
    assert metric(D_PORT, "tandem_kv_transfer_failures_total") == failures + 1
    assert wait_for(lambda: at_baseline(P_PORT) and at_baseline(D_PORT), timeout_s=30)


def test_expired_lease_is_refused_and_the_decode_node_recomputes(fc: FaultCluster) -> None:
    msgs = prompt(300, "exp")
    want = reference(fc, msgs)
    expired = outcome(P_PORT, "expired")
    arm(P_PORT, "expire")
    assert text(chat(fc, msgs, PD)) == want
    assert wait_for(lambda: outcome(P_PORT, "expired") == expired + 1, timeout_s=30)
    assert wait_for(lambda: at_baseline(P_PORT) and at_baseline(D_PORT), timeout_s=30)


def raw_post(port: int, body: dict, headers: dict[str, str] | None = None) -> socket.socket:
    """A request on a socket the caller closes (from its own thread: no read is blocked on it, so the
    close sends the FIN at once and the server sees the client leave). An HTTP client would still be
    waiting for headers when a test wants to hang up, and closing it from another thread leaves its
    blocked read holding the socket open."""
    data = json.dumps(body)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(data)}\r\n\r\n{data}"
        ).encode()
    )
    return sock


def test_client_gone_before_first_token_frees_both_sides(fc: FaultCluster) -> None:
    arm(P_PORT, "hold", 3.0)  # the decode node waits for its KV while the client leaves
    body = {"model": fc.model, "messages": prompt(300, "gone"), "max_tokens": 64, "stream": True}
    with raw_post(ROUTER_PORT, body, PD):
        assert wait_for(lambda: metric(P_PORT, "tandem_kv_leases_active") == 1, timeout_s=60)
    t0 = time.monotonic()
    assert wait_for(lambda: at_baseline(P_PORT) and at_baseline(D_PORT), timeout_s=LEASE_S + 10)
    assert time.monotonic() - t0 < LEASE_S, "freed by the deadline, not by the disconnect"
    assert outcome(P_PORT, "released") + outcome(P_PORT, "failed") >= 1


def test_full_decode_node_rejects_and_releases_the_lease_at_once(fc: FaultCluster) -> None:
    long_msgs = prompt(660, "big")  # ~1930 tokens: 16 of the decode node's 20 blocks
    want = reference(fc, long_msgs, max_tokens=4)
    released = outcome(P_PORT, "released")
    holder_body = {
        "model": fc.model,
        "messages": prompt(200, "hold"),
        "max_tokens": 1400,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=DEADLINE_S) as client,
        client.stream("POST", f"{fc.url}/v1/chat/completions", json=holder_body, headers=PD) as holder,
    ):
        lines = holder.iter_lines()
        assert any(line.startswith("data:") for line in lines)  # the holder is decoding: its blocks are taken
        victim = Background(lambda: chat(fc, long_msgs, PD, max_tokens=4))
        assert wait_for(lambda: outcome(P_PORT, "released") == released + 1, timeout_s=DEADLINE_S), (
            "the decode node did not release the lease it had no room for"
        )
        assert metric(P_PORT, "tandem_kv_leases_active") == 0
        # leaving closes the holder: the victim gets its room and prefills locally
    resp = victim.join()
    assert text(resp) == want
    assert resp.json()["usage"]["tandem"]["mode"] == "disaggregated"
    assert wait_for(lambda: at_baseline(P_PORT) and at_baseline(D_PORT), timeout_s=30)


def _chat_body(fc: FaultCluster, messages: list[dict[str, str]], max_tokens: int) -> dict:
    return {"model": fc.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def test_layerwise_corrupted_layer_is_caught_and_the_decode_node_recomputes(fc: FaultCluster) -> None:
    msgs = prompt(300, "lwcrc")
    want = reference(fc, msgs)
    failed, failures = outcome(P_PORT, "failed"), metric(D_PORT, "tandem_kv_transfer_failures_total")
    arm(P_PORT, "corrupt")
    resp = layerwise_chat(node_url(P_PORT), node_url(D_PORT), P_PORT, _chat_body(fc, msgs, 8), "tcp")
    assert text(resp) == want
    report = resp.json()["kv_transfer_params"]["tandem_transfer"]
    assert not report["ok"] and "checksum" in report["reason"], report
    assert wait_for(lambda: outcome(P_PORT, "failed") == failed + 1, timeout_s=30)
    assert metric(D_PORT, "tandem_kv_transfer_failures_total") == failures + 1
    assert wait_for(lambda: at_baseline(P_PORT) and at_baseline(D_PORT), timeout_s=30)


def first_tokens(port: int) -> float:
    """Requests that got their first token on this engine: a prefill aborted half-way never does (vLLM
    counts no aborted request in ``vllm:request_success_total``)."""
    return metric(port, "vllm:time_to_first_token_seconds_count")


def test_layerwise_prefill_aborted_half_way_the_decode_node_recomputes(fc: FaultCluster) -> None:
    """Both legs straight to the engines; the prefill leg's client leaves while the decode node pulls the
    prefill's layers: vLLM aborts the prefill between two chunks, its lease ends failed, the pull gets a
    Reject and the decode node recomputes the right answer."""
    msgs = prompt(500, "lwcut")  # ~2k tokens: eight prefill chunks of 256, none cached yet
    failed, firsts = outcome(P_PORT, "failed"), first_tokens(P_PORT)
    body = _chat_body(fc, msgs, 8)
    with ThreadPoolExecutor(1) as pool:
        tid, answer = start_decode_leg(pool, node_url(D_PORT), body, P_PORT, "tcp")
        prefill = {**body, "max_tokens": 1, "kv_transfer_params": prefill_params(tid)}
        with raw_post(P_PORT, prefill, engine_auth_headers(loopback_only=True)):
            # the decode node's pull is being served while the prefill computes
            assert wait_for(lambda: metric(P_PORT, "tandem_kv_leases_sending") == 1, timeout_s=60)
        resp = answer.result(timeout=DEADLINE_S)
    report = resp.json()["kv_transfer_params"]["tandem_transfer"]
    assert not report["ok"] and "finished_aborted" in report["reason"], report  # the prefill's own end
    assert first_tokens(P_PORT) == firsts  # it never finished
    assert text(resp) == reference(fc, msgs)  # asked after: the prefill node must compute the prompt above
    assert wait_for(lambda: outcome(P_PORT, "failed") == failed + 1, timeout_s=30)
    assert wait_for(lambda: at_baseline(P_PORT) and at_baseline(D_PORT), timeout_s=30)


def test_layerwise_router_equals_the_reference_and_ends_its_lease_done(fc: FaultCluster) -> None:
    msgs = prompt(300, "lwok")
    want = reference(fc, msgs)
    done = outcome(P_PORT, "done")
    pairs = engine_metric(fc.lw_url, "tandem_pd_pairs_total", mode="layerwise")
    assert text(chat(fc, msgs, PD, url=fc.lw_url)) == want
    assert engine_metric(fc.lw_url, "tandem_pd_pairs_total", mode="layerwise") == pairs + 1
    assert wait_for(lambda: outcome(P_PORT, "done") == done + 1, timeout_s=30)
    assert wait_for(lambda: at_baseline(P_PORT) and at_baseline(D_PORT), timeout_s=30)


def test_layerwise_client_gone_mid_prefill_cancels_both_legs(fc: FaultCluster) -> None:
    """Through the layer-wise router: the client leaves while the prefill computes and the decode node
    pulls; the router cancels both legs, so the prefill is aborted half-way, and both nodes are back at
    baseline long before any lease deadline."""
    firsts = first_tokens(P_PORT)
    ended = outcome(P_PORT, "failed") + outcome(P_PORT, "released")
    body = {"model": fc.model, "messages": prompt(500, "lwgone"), "max_tokens": 64, "stream": True}
    with raw_post(ROUTER_LW_PORT, body, PD):
        assert wait_for(lambda: metric(P_PORT, "tandem_kv_leases_sending") == 1, timeout_s=60)
    t0 = time.monotonic()
    assert wait_for(lambda: at_baseline(P_PORT) and at_baseline(D_PORT), timeout_s=LEASE_S + 10)
    assert time.monotonic() - t0 < LEASE_S, "freed by the deadline, not by the disconnect"
    assert first_tokens(P_PORT) == firsts  # the prefill was aborted before it finished
    assert outcome(P_PORT, "failed") + outcome(P_PORT, "released") == ended + 1


def test_decode_node_killed_mid_transfer(fc: FaultCluster) -> None:
    msgs = prompt(300, "dkill")
    want = reference(fc, msgs)
    arm(P_PORT, "stall", 3.0)  # the transfer stops after its first layer, and the decode node dies
    req = Background(lambda: chat(fc, msgs, PD))
    assert wait_for(lambda: metric(P_PORT, "tandem_kv_leases_sending") == 1, timeout_s=60)
    fc.kill("d")
    resp = req.join()
    assert text(resp) == want  # served again by the prefill node
    assert resp.json()["usage"]["tandem"]["mode"] == "colocated"
    assert req.elapsed < DEADLINE_S
    assert wait_for(lambda: at_baseline(P_PORT), timeout_s=LEASE_S + 10)
    assert outcome(P_PORT, "expired") + outcome(P_PORT, "released") >= 1


def test_prefill_node_killed_after_prefill_before_transfer(fc: FaultCluster) -> None:
    fc.start_node("d2", "decode", D2_PORT, "1")
    # the killed decode node must have left the registry and the new one joined
    assert wait_for(lambda: fc.nodes() == {"kvf-p": "prefill", "kvf-d2": "decode"}, timeout_s=900), fc.log("d2")
    msgs = prompt(300, "pkill")
    want = reference(fc, msgs)
    arm(P_PORT, "hold", 60.0)  # the prefill finishes, the lease is held, the pull is never answered
    req = Background(lambda: chat(fc, msgs, PD))
    assert wait_for(lambda: metric(P_PORT, "tandem_kv_leases_active") == 1, timeout_s=60)
    fc.kill("p")
    resp = req.join()
    assert text(resp) == want  # the decode node's pull timed out and it prefilled itself
    assert req.elapsed < LEASE_S + TRANSFER_TIMEOUT_S + 30
    assert metric(D2_PORT, "tandem_kv_transfer_failures_total") >= 1
    assert wait_for(lambda: at_baseline(D2_PORT), timeout_s=30)
