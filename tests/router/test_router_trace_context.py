"""With an OTLP endpoint configured, each leg of a P/D request carries a W3C ``traceparent`` naming the
router's span of that leg (``tandem.prefill`` for the prefill leg, ``tandem.decode`` for the decode
leg), so that an engine with ``--otlp-traces-endpoint`` nests its own spans under the router's; the
spans the router exports carry those very ids. Without an endpoint no leg carries one. Stand-in
engines (the labelled test double, which records the header) behind the real router; a local
OTLP/HTTP endpoint (``tests.support.otlp_collector``) receives the router's spans."""

from __future__ import annotations

import re

import httpx
import pytest

from contracts.registry import Role
from tests.support.otlp_collector import OtlpCollector
from tests.support.standin_cluster import standin_cluster

CHAT = "/v1/chat/completions"
PD = {"x-tandem-route": "disaggregated"}
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-01$")


def _ids(header: str | None) -> tuple[int, int]:
    """(trace id, parent span id) of a traceparent header."""
    m = TRACEPARENT.match(header or "")
    assert m, header
    return int(m.group(1), 16), int(m.group(2), 16)


async def test_pd_legs_carry_the_trace_context_of_the_router_spans_of_their_leg(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # the router's span batches go out at once, not in 5 s
    with OtlpCollector() as collector:
        roles = {"pre": Role.PREFILL, "dec": Role.DECODE}
        async with standin_cluster(tmp_path, roles, router={"otlp_traces_endpoint": collector.url}) as c:
            async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
                for stream in (False, True):  # the decode leg as one answer, then as a stream
                    r = await client.post(CHAT, json=c.chat(f"trace {stream}", stream=stream), headers=PD)
                    assert r.status_code == 200, r.text
            prefill_legs = [_ids(h) for h in c.engines["pre"].traceparents]
            decode_legs = [_ids(h) for h in c.engines["dec"].traceparents]
            assert len(prefill_legs) == len(decode_legs) == 2
            assert all("kv_transfer_params" in b for b in c.engines["dec"].bodies())  # both went P/D
            for (p_trace, p_span), (d_trace, d_span) in zip(prefill_legs, decode_legs, strict=True):
                assert p_trace == d_trace and p_span != d_span  # one trace, a span per leg
            assert prefill_legs[0][0] != prefill_legs[1][0]  # a trace per request

            want = {t for t, _ in prefill_legs}
            spans = collector.wait_for(lambda spans: want <= {s.trace_id for s in spans if s.name == "tandem.request"})
    for (trace_id, p_span), (_, d_span) in zip(prefill_legs, decode_legs, strict=True):
        mine = {s.name: s for s in spans if s.trace_id == trace_id}
        # The prefill engine's span would be a child of tandem.prefill, the decode engine's of tandem.decode.
        assert mine["tandem.prefill"].span_id == p_span and mine["tandem.decode"].span_id == d_span
        root = mine["tandem.request"].span_id
        assert mine["tandem.prefill"].parent_span_id == root and mine["tandem.decode"].parent_span_id == root
        assert {s.service for s in mine.values()} == {"tandem-router"}


@pytest.mark.parametrize("stream", [False, True])
async def test_without_an_otlp_endpoint_no_leg_carries_a_traceparent(tmp_path, stream: bool) -> None:
    async with standin_cluster(tmp_path, {"pre": Role.PREFILL, "dec": Role.DECODE}) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
            r = await client.post(CHAT, json=c.chat("untraced", stream=stream), headers=PD)
            assert r.status_code == 200, r.text
        assert len(c.engines["pre"].bodies()) == len(c.engines["dec"].bodies()) == 1
        assert c.engines["pre"].traceparents == c.engines["dec"].traceparents == [None]
