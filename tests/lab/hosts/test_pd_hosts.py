"""P/D across hosts of the lab (issue 38, first acceptance item): a router host, a prefill host, a decode
host, a colocated node's host and a store host (Redis, PostgreSQL), each a network namespace with its own
address (``tests/lab/cluster.py``; the cluster of ``tests/lab/hosts/conftest.py``, which
``test_faults_hosts`` ran its faults on first). Every request comes from a client host, over the lab's
bridge.

- Disaggregated answers equal colocated ones token for token (float32, greedy, as
  ``tests/e2e/test_pd_equivalence.py`` on loopback), the decode node computed no prompt token itself, and
  the KV crossed the network: the decode host's link received at least the bytes its engine counts as
  pulled, so the pull went over tcp, not through a kernel copy between processes of one machine (the
  ``auto`` transport takes another network namespace for another host: ``kv_transfer.settings.host_id``).
- A client on another host without the cluster's credentials is refused by every engine port (401 on
  ``/v1`` and ``/invocations``, with no key or a wrong one), by the prefill node's block server (its
  messages are rejected unread and counted) and by a node's KV-event relay (no event, no replay), while
  the same calls with the cluster's credentials, from the same host, succeed: the refusals are the
  credentials', not the network's. The stores refuse it too (no password, no registry).
- A partition of the decode host mid-stream ends the client's stream with an error event within
  ``CUT_DETECTED_S`` (the router's engine connections carry TCP keepalive:
  ``RouterSettings.upstream_dead_after_s``; before it, the stream hung for the 600 s read timeout), the
  colocated node serves meanwhile, nothing stays leased or running, and P/D answers again after the heal.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
import zmq

from contracts.secret import curve_keys
from kv_transfer import wire
from node_agent.kv_events_relay import END_SEQ
from tests.e2e.conftest import engine_metric, prompt_tokens_by_source
from tests.lab.cluster import NODES, LabCluster
from tests.lab.hosts.support import received, story, stream_through_a_fault
from tests.support.helpers import wait_for

pytestmark = pytest.mark.e2e
MAX_TOKENS = 16
CUT_DETECTED_S = 30.0
"""How long after a partition a stream from the lost host may take to end with an error: the router's
upstream_dead_after_s (15 s) and slack for a 2-core host."""
_MODULE = "\n".join(
    f"def handler_{i}(request, registry):\n"
    f"    node = registry.lookup(request.prefix_hash, shard={i % 7})\n"
    f"    return node.submit(request, priority={i % 3})\n"
    for i in range(12)
)
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And what river runs through it?"},
    ],
    [
        {"role": "system", "content": "You review code."},
        {"role": "user", "content": f"Here is a module:\n```python\n{_MODULE}\n```\nWhat does handler_3 do?"},
    ],
]
"""Small prompts (2 cores, three engines): two under one KV block, one of a few blocks."""


def _chat(http: httpx.Client, lc: LabCluster, messages: list[dict[str, str]], route: str) -> dict:
    resp = http.post(
        f"{lc.router_url}/v1/chat/completions",
        headers={"x-tandem-route": route},
        json={
            "model": lc.model,
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_pd_between_hosts_equals_colocated_and_the_kv_crosses_the_network(lc: LabCluster) -> None:
    decode = lc.engine_url("decode")
    link_before = received(lc, "decode")
    with lc.lab.inside("client"), httpx.Client(timeout=300) as http:
        before = prompt_tokens_by_source(decode)
        pulled_before = engine_metric(decode, "tandem_kv_transfer_bytes_total")
        pd_prompt_tokens = 0
        for messages in CHATS:
            pd = _chat(http, lc, messages, "disaggregated")
            colo = _chat(http, lc, messages, "colocated")
            pd_ids, colo_ids = pd["choices"][0]["token_ids"], colo["choices"][0]["token_ids"]
            assert pd_ids and len(pd_ids) == pd["usage"]["completion_tokens"]
            assert pd_ids == colo_ids, f"P/D and colocated differ for {messages[-1]['content'][:40]!r}"
            assert pd["choices"][0]["message"]["content"] == colo["choices"][0]["message"]["content"]
            pd_prompt_tokens += pd["usage"]["prompt_tokens"]
        after = prompt_tokens_by_source(decode)
        pulled = engine_metric(decode, "tandem_kv_transfer_bytes_total") - pulled_before
    link = received(lc, "decode") - link_before
    loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
    reused = after["local_cache_hit"] - before["local_cache_hit"]
    assert after["local_compute"] == before["local_compute"], "the decode node computed prompt tokens itself"
    assert loaded + reused == pd_prompt_tokens and loaded >= 0.5 * pd_prompt_tokens
    # float32 KV of ~200 prompt tokens is megabytes; the requests and answers that also cross the link
    # are kilobytes. A pull through shm or ipc would leave the link with the kilobytes only.
    assert pulled > 1_000_000, f"only {pulled:.0f} KV bytes pulled"
    assert link >= pulled, f"the decode host's link received {link} bytes, its engine pulled {pulled:.0f}"


def test_a_host_without_the_cluster_credentials_is_refused_everywhere(lc: LabCluster) -> None:
    body = {"model": lc.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    wrong = {"Authorization": "Bearer not-the-engine-key"}
    with lc.lab.inside("client"), httpx.Client(timeout=60) as http:
        for host in NODES:
            engine = lc.engine_url(host)
            assert http.get(f"{engine}/health").status_code == 200  # reachable: what follows is refusal
            for headers in ({}, wrong):
                for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/invocations")):
                    resp = http.request(method, f"{engine}{path}", json=body, headers=headers)
                    assert resp.status_code == 401, f"{host} {path} with {headers or 'no key'}: {resp.status_code}"
            assert http.get(f"{engine}/v1/models", headers=lc.engine_headers).status_code == 200

        # The stores: no password, nothing read.
        outsider = redis.Redis(host=lc.lab.address("store"), port=6379, socket_timeout=5)
        with pytest.raises(redis.AuthenticationError):
            outsider.get("tandem:nodes")
        outsider.close()

        _block_server_refuses(lc, http)
        _relay_refuses(lc, http)


def _block_server_refuses(lc: LabCluster, http: httpx.Client) -> None:
    prefill = lc.engine_url("prefill")
    member = wire.Codec(lc.secret.encode())
    refused_before = engine_metric(prefill, "tandem_kv_unauthenticated_total")
    ctx = zmq.Context()  # made here: its I/O thread is the client host's
    try:

        def ask(payload: bytes) -> wire.Message:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(lc.block_server("prefill"))
            sock.send(payload)
            assert sock.poll(10_000), "the block server did not answer"
            answer = member.decode(sock.recv())  # the test can read the answer: it holds the secret
            sock.close()
            return answer

        for who, payload in (
            ("another cluster's secret", wire.Codec(b"o" * 32).encode(wire.Query("probe"))),
            ("no signature", b'{"kv.query.v1": {"transfer_id": "probe"}}'),
        ):
            answer = ask(payload)
            assert isinstance(answer, wire.Reject) and answer.reason.startswith("unauthenticated"), (who, answer)
        answer = ask(member.encode(wire.Query("probe")))  # a member, from the same host: served
        assert not (isinstance(answer, wire.Reject) and answer.reason.startswith("unauthenticated")), answer
    finally:
        ctx.destroy(linger=0)

    # The engine publishes its connector's counters when it steps: one request through the router.
    def counted() -> bool:
        _chat(http, lc, [{"role": "user", "content": "Count to three."}], "disaggregated")
        return engine_metric(prefill, "tandem_kv_unauthenticated_total") >= refused_before + 2

    assert wait_for(counted, 120, interval_s=1.0), "the refused messages were not counted"


def _relay_refuses(lc: LabCluster, http: httpx.Client) -> None:
    events, replay = lc.relay("colo")
    keys = curve_keys(lc.secret.encode())
    ctx = zmq.Context()

    def client(kind: int, endpoint: str, cluster_keys: object | None) -> zmq.Socket:
        sock = ctx.socket(kind)
        sock.linger = 0
        if cluster_keys is not None:
            sock.curve_serverkey = keys.server_public
            sock.curve_publickey = cluster_keys.client_public  # type: ignore[attr-defined]
            sock.curve_secretkey = cluster_keys.client_secret  # type: ignore[attr-defined]
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        return sock

    outsiders = {"no keys": None, "another cluster's keys": curve_keys(b"x" * 32)}
    try:
        member = client(zmq.SUB, events, keys)
        subs = {who: client(zmq.SUB, events, k) for who, k in outsiders.items()}
        # The member's subscription is the clock: each round stores new blocks on the colocated node (a
        # prompt of two blocks it has not seen) until an event reaches the member; an outsider connected
        # as long would have had it too.
        for i in range(20):
            _chat(http, lc, [{"role": "user", "content": f"Round {i}: {_MODULE}"}], "colocated")
            if member.poll(2000):
                break
        else:
            pytest.fail("no KV event reached the cluster's own subscriber")
        for who, sub in subs.items():
            assert not sub.poll(500), f"{who}: a KV event reached a subscriber outside the cluster"

        good = client(zmq.DEALER, replay, keys)
        bad = {who: client(zmq.DEALER, replay, k) for who, k in outsiders.items()}
        for sock in (*bad.values(), good):
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while good.poll(10_000):
            replies.append(good.recv_multipart())
            if replies[-1][2] == END_SEQ:
                break
        assert len(replies) > 1 and replies[-1][2] == END_SEQ, "the member got no replay"
        for who, sock in bad.items():
            assert not sock.poll(500), f"{who}: the relay replayed events to a client outside the cluster"
    finally:
        ctx.destroy(linger=0)


def test_the_decode_host_cut_mid_stream_ends_the_stream_cleanly_and_the_cluster_recovers(
    lc: LabCluster, machine: ThreadPoolExecutor
) -> None:
    """A partition (the decode host's link down: packets vanish, nothing is refused) while the decode node
    streams an answer: the client gets an error event and ``[DONE]`` within ``CUT_DETECTED_S``, not a
    stream that hangs until some read timeout; the colocated node serves meanwhile; the prefill node holds
    no lease and the decode engine no request once the link is back; P/D answers again, token for token."""
    prefill, decode = lc.engine_url("prefill"), lc.engine_url("decode")
    body = story(lc, 400)
    try:
        with lc.lab.inside("client"), httpx.Client(timeout=httpx.Timeout(10, read=CUT_DETECTED_S * 3)) as http:
            ended_after = stream_through_a_fault(http, lc, body, lambda: machine.submit(lc.lab.cut, "decode").result())
            assert ended_after < CUT_DETECTED_S, f"the stream took {ended_after:.1f} s to end after the cut"
            print(f"lab: the stream ended {ended_after:.1f} s after the decode host was cut")

            # The rest of the fleet serves while the decode host is away.
            colo = _chat(http, lc, CHATS[0], "colocated")
            assert colo["choices"][0]["token_ids"]

            machine.submit(lc.lab.heal, "decode").result()

            def pd_again() -> bool:
                resp = http.post(
                    f"{lc.router_url}/v1/chat/completions",
                    headers={"x-tandem-route": "disaggregated"},
                    json={**body, "messages": CHATS[0], "max_tokens": MAX_TOKENS, "stream": False},
                )
                return resp.status_code == 200

            assert wait_for(pd_again, 120, interval_s=2.0), "P/D did not come back after the heal"
            pd = _chat(http, lc, CHATS[1], "disaggregated")
            assert pd["choices"][0]["token_ids"] == _chat(http, lc, CHATS[1], "colocated")["choices"][0]["token_ids"]
            # Nothing stranded: the prefill node's leases all ended, the decode engine runs nothing.
            assert wait_for(lambda: engine_metric(prefill, "tandem_kv_leases_active") == 0, 60, interval_s=1.0)
            assert engine_metric(prefill, "tandem_kv_leased_blocks") == 0
            busy = ("vllm:num_requests_running", "vllm:num_requests_waiting")
            assert wait_for(lambda: sum(engine_metric(decode, m) for m in busy) == 0, 60, interval_s=1.0)
    finally:
        machine.submit(lc.lab.heal, "decode").result()  # idempotent: the next test gets a whole lab
