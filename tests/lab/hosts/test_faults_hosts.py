"""Faults between the hosts of the lab (issue 38, item 3): a partition between prefill and decode during a
KV pull, the store host (Redis, PostgreSQL) cut off from everyone, and a whole host lost. The lab
cluster of ``tests/lab/hosts/conftest.py`` (with a lake writer on the store host); every request comes from
the client host.

Each fault ends with the same checks, read from what the components publish:

- no hung stream: every request ends (an answer, an error event, or the API's error) within a bound;
- nothing stranded: the prefill node's block server holds no lease and no block
  (``tandem_kv_leases_active``, ``tandem_kv_leased_blocks``), the engines run nothing;
- no lake row lost: every answered request's response id is in the lake's ``requests`` table once the
  writer has drained (the router's telemetry is buffered while Redis is away, not dropped);
- the rest of the fleet serves during the fault, and the whole cluster after the heal.

The pull cut: the decode node pulls a long prompt's KV (tens of MB) from the prefill host; the test
watches the decode host's link and cuts the prefill host when the KV starts to flow. The decode node's
pull then times out (``tandem_kv_transfer_failures``), and so does the router's layer-wise prefill leg,
which prefills on the decode node instead; under the default ``kv_load_failure_policy`` (``recompute``)
no block of the failed pull is trusted. The client gets its whole answer, the colocated node's token for
token. (vLLM's per-request token accounting, ``prompt_tokens_by_source`` and ``iteration_tokens``, is
fixed at a request's first scheduling, so it cannot show a recompute: the answer is the evidence.)
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import engine_metric
from tests.lab.cluster import NODES, LabCluster, node_id
from tests.lab.hosts.support import received, story, stream_through_a_fault
from tests.support.helpers import wait_for

pytestmark = pytest.mark.e2e
MAX_TOKENS = 8
ENDED_S = 30.0
"""How long a request hit by a fault may take to end: the decode node's pull timeout (10 s) plus its
recompute, or the router's upstream_dead_after_s (15 s), and slack for a 2-core host."""
STORE_CUT_S = 20.0
"""Longer than the registry's entry TTL (15 s): every node's entry expires in Redis during the cut."""
_LONG = "\n".join(f"def handler_{i}(request):\n    return request.shard({i}) + {i * 7}" for i in range(80))


ANSWERED: list[str] = []
"""Response ids of every answered request of the module: all must reach the lake."""


def _chat(http: httpx.Client, lc: LabCluster, content: str, route: str, max_tokens: int = MAX_TOKENS) -> dict:
    resp = http.post(
        f"{lc.router_url}/v1/chat/completions",
        headers={"x-tandem-route": route},
        json={
            "model": lc.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    )
    assert resp.status_code == 200, f"{route}: {resp.status_code} {resp.text[:300]}"
    body = resp.json()
    assert body["choices"][0]["message"]["content"]
    ANSWERED.append(body["id"])
    return body


def _nothing_stranded(lc: LabCluster, http: httpx.Client) -> None:
    assert wait_for(lambda: lc.kv_held("prefill", http) == (0, 0), 60, interval_s=1.0), (
        f"the prefill node still holds (leases, blocks) = {lc.kv_held('prefill', http)}"
    )
    for host in NODES:
        assert wait_for(lambda host=host: lc.busy(host, http) == 0, 60, interval_s=1.0), f"{host} still busy"


def _lake_has_every_answer(lc: LabCluster) -> None:
    missing: set[str] = set(ANSWERED)

    def drained() -> bool:
        missing.intersection_update(set(ANSWERED) - lc.lake_response_ids())
        return not missing

    assert wait_for(drained, 90, interval_s=2.0), f"{len(missing)} of {len(ANSWERED)} answers have no lake row"


def test_prefill_host_cut_during_the_kv_pull(lc: LabCluster, machine: ThreadPoolExecutor) -> None:
    decode = lc.engine_url("decode")
    prompt = f"Here is a module:\n```python\n{_LONG}\n```\nWhich handler adds the most?"
    try:
        with lc.lab.inside("client"), httpx.Client(timeout=httpx.Timeout(10, read=ENDED_S * 3)) as http:
            failures = engine_metric(decode, "tandem_kv_transfer_failures_total")
            client = ThreadPoolExecutor(1)  # started here: its thread is the client host's
            link = received(lc, "decode")
            started = time.monotonic()
            answer = client.submit(_chat, http, lc, prompt, "disaggregated")
            # The KV of ~2k float32 tokens is ~90 MB; a request or an answer is kilobytes. The first
            # megabyte on the decode host's link is the pull under way.
            while received(lc, "decode") - link < 1_000_000 and not answer.done():
                time.sleep(0.001)  # a byte counter in sysfs: nothing to wait on
            assert not answer.done(), f"the request ended before any KV flowed: {answer.exception()}"
            machine.submit(lc.lab.cut, "prefill").result()
            body = answer.result(timeout=ENDED_S * 3)
            took = time.monotonic() - started
            client.shutdown()
            assert took < ENDED_S * 2, f"the request took {took:.1f} s"
            print(f"lab: a pull cut mid-way, answered by recompute in {took:.1f} s")
            machine.submit(lc.lab.heal, "prefill").result()
            assert engine_metric(decode, "tandem_kv_transfer_failures_total") == failures + 1, "no pull failed"
            # Checked before the comparison below: an engine still busy with the fault's work would slow
            # the colocated node (it shares decode's core), and this names it.
            _nothing_stranded(lc, http)
            # The answer is the colocated node's, token for token (greedy, float32): nothing was decoded
            # from a half-pulled block.
            colo = _chat(http, lc, prompt, "colocated")
            assert body["choices"][0]["message"]["content"] == colo["choices"][0]["message"]["content"]
            _chat(http, lc, "What is the capital of France?", "disaggregated")
            _chat(http, lc, "Name a river.", "colocated")
    finally:
        machine.submit(lc.lab.heal, "prefill").result()
    _lake_has_every_answer(lc)


def test_the_store_host_cut_the_fleet_serves_from_its_last_view(lc: LabCluster, machine: ThreadPoolExecutor) -> None:
    """Redis and PostgreSQL unreachable from every host for longer than a registry entry lives: the router
    keeps routing on the fleet it last saw, the nodes keep serving, the telemetry waits in the router;
    after the heal the nodes register again and every answer reaches the lake."""
    try:
        with lc.lab.inside("client"), httpx.Client(timeout=httpx.Timeout(10, read=ENDED_S * 2)) as http:
            # Through an outage the router admits what the store confirmed within its grace (a key, or
            # auth off: ``router.admission.outage``); this request confirms it now, whatever the test
            # before took.
            _chat(http, lc, "Count to 2.", "colocated")
            machine.submit(lc.lab.cut, "store").result()
            cut_at = time.monotonic()
            took: list[float] = []
            while time.monotonic() - cut_at < STORE_CUT_S:
                for route in ("disaggregated", "colocated"):
                    t = time.monotonic()
                    _chat(http, lc, f"Count to {len(took) + 3}.", route)
                    took.append(time.monotonic() - t)
            machine.submit(lc.lab.heal, "store").result()
            print(
                f"lab: {len(took)} requests answered while the store host was cut for {STORE_CUT_S:.0f} s "
                f"(each {min(took):.2f}-{max(took):.2f} s)"
            )

            everyone = {node_id(h) for h in NODES}
            assert wait_for(lambda: lc.registered() >= everyone, 60, interval_s=1.0), lc.registered()
            assert wait_for(lambda: lc.router_nodes(http) >= len(NODES), 60, interval_s=1.0)
            _chat(http, lc, "And after the heal?", "disaggregated")
            _nothing_stranded(lc, http)
    finally:
        machine.submit(lc.lab.heal, "store").result()
    _lake_has_every_answer(lc)


def test_the_decode_host_lost_whole(lc: LabCluster, machine: ThreadPoolExecutor) -> None:
    """Every process of the decode host SIGKILLed at once mid-stream: the stream ends with an error event,
    the colocated node serves, the lost node's registry entry expires (nobody deregistered it), and a
    node started again on the host serves P/D."""
    body = story(lc, 300)
    with lc.lab.inside("client"), httpx.Client(timeout=httpx.Timeout(10, read=ENDED_S * 2)) as http:

        def lose() -> None:
            assert machine.submit(lc.lose_host, "decode").result(), "no process on the decode host"

        ended_after = stream_through_a_fault(http, lc, body, lose)
        assert ended_after < ENDED_S, f"the stream took {ended_after:.1f} s to end"
        print(f"lab: the stream ended {ended_after:.1f} s after its decode host was lost")

        _chat(http, lc, "Name a colour.", "colocated")
        gone = node_id("decode")
        assert wait_for(lambda: gone not in lc.registered(), 45, interval_s=1.0), "the lost node is still registered"
        # Without a decode node a P/D request is answered by the colocated node or refused, never hung.
        resp = http.post(
            f"{lc.router_url}/v1/chat/completions",
            headers={"x-tandem-route": "disaggregated"},
            json={**body, "stream": False, "max_tokens": MAX_TOKENS},
        )
        assert resp.status_code in (200, 503), resp.text[:300]
        if resp.status_code == 200:
            ANSWERED.append(resp.json()["id"])
        else:
            assert "error" in resp.json()

        machine.submit(lc.start_node, "decode").result()
        assert wait_for(lambda: gone in lc.registered() and lc.router_nodes(http) >= len(NODES), 300, interval_s=2.0)
        _chat(http, lc, "What is the capital of Italy?", "disaggregated")
        _nothing_stranded(lc, http)
    _lake_has_every_answer(lc)
