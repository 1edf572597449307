"""Routing decisions as data: a policy's reason code and figures reach ``usage.tandem`` and the lake's
``requests`` rows (through the real emitter and lake writer), and lakes written under schema version 1
(no such columns) stay readable, alone or mixed with version-2 parts."""

from __future__ import annotations

import io
import random
import time

import pyarrow as pa
import pyarrow.parquet as pq

from contracts.registry import Role
from router.kv_index import BlockHasher, FleetIndex, prefix_view
from router.planning.orchestrator import RequestTrace, note_decision, record_usage
from router.policies import CacheAware, CacheAwareConfig, ReasonCode, RoutingRequest
from router.record.records import request_record
from telemetry.query import query
from telemetry.schemas import SCHEMAS
from tests.router.policies.helpers import cand

BS = 16
HASHER = BlockHasher(BS)
PROMPT = [random.Random(7).randrange(49_152) for _ in range(1000)]


def _traced(fleet: FleetIndex, policy: CacheAware, prefill: list, decode: list, rid: str) -> RequestTrace:
    """A request routed by ``policy`` whose engine then reused what the index predicted."""
    rr = RoutingRequest(
        request_id=rid, model="m", prompt_token_ids=tuple(PROMPT), block_keys=tuple(HASHER.keys(PROMPT))
    )
    decision = policy.select(rr, prefill, decode)
    trace = RequestTrace(request_id=rid, kind="chat", model="m", prompt_tokens=len(PROMPT))
    trace.mode = "disaggregated" if decision.prefill else "colocated"
    trace.decode_node, trace.decode_role = decision.decode.node_id, decision.decode.node.info.role.value
    trace.prefill_node = decision.prefill.node_id if decision.prefill else None
    note_decision(trace, decision)
    trace.prefix_view = prefix_view(
        fleet,
        "m",
        rr.block_keys,
        prompt_tokens=len(PROMPT),
        block_size=BS,
        routed_node=(decision.prefill or decision.decode).node_id,
        live_nodes={c.node_id for c in prefill + decode},
        reason_code=decision.code.value,
        now=time.time(),
    )
    trace.engine_cached_tokens = trace.prefix_view.routed_tokens
    return trace


def _two_decisions() -> list[RequestTrace]:
    fleet = FleetIndex()
    fleet.model("m", BS).add_blocks("p1", HASHER.keys(PROMPT[:800]))
    guarded = CacheAware(fleet, CacheAwareConfig(imbalance_threshold=2, waiting_request_tokens=0))
    decode = [cand("d0", Role.DECODE)]
    return [
        _traced(fleet, guarded, [cand("p0"), cand("p1")], decode, "r-cache"),
        _traced(fleet, guarded, [cand("p0"), cand("p1", inflight=3)], decode, "r-guard"),
    ]


def test_usage_tandem_carries_the_code_and_its_figures() -> None:
    cache, guard = _two_decisions()
    usage: dict = {"prompt_tokens": 1000, "completion_tokens": 1}
    record_usage(guard, usage)
    t = usage["tandem"]
    assert (t["reason_code"], t["decode_reason_code"], t["threshold"], t["load"]) == ("load_guard", "least_busy", 2, 3)
    assert t["uncached_tokens"] == 1000 and type(t["reason_code"]) is str  # plain JSON, not an enum
    # p1 held 800 tokens; the guard sent the prompt to p0: those 800 are "elsewhere", for that reason
    assert t["miss"] == {
        "cold": 200,
        "evicted": 0,
        "elsewhere": 800,
        "undelivered": 0,
        "evicted_node": None,
        "evicted_tier": None,
        "evicted_ago_s": None,
        "elsewhere_node": "p1",
        "elsewhere_reason": "load_guard",
    }
    assert t["reason"].startswith("load guard")  # the sentence stays, for people
    usage = {"prompt_tokens": 1000}
    record_usage(cache, usage)
    assert usage["tandem"]["reason_code"] == ReasonCode.BEST_PREFIX == "best_prefix"
    assert usage["tandem"]["uncached_tokens"] == 1000 - 800
    assert usage["tandem"]["miss"]["cold"] == 200 and usage["tandem"]["miss"]["elsewhere"] == 0


def test_lake_rows_group_by_code_not_by_sentence(make_emitter, make_writer, lake) -> None:
    cache, guard = _two_decisions()
    e = make_emitter(start=False)
    for trace in (cache, guard, guard):
        trace.finish = time.time()
        e.emit("requests", request_record(trace, endpoint="chat", http_status=200))
    e.flush()
    make_writer().drain()
    rows = query(
        lake,
        """SELECT routing_reason_code AS code, any_value(routing_decode_reason_code) AS d,
                  any_value(routing_threshold) AS th, any_value(routing_load) AS load,
                  any_value(uncached_tokens) AS unc, count(*) AS n
           FROM requests GROUP BY 1 ORDER BY 1""",
    ).to_pylist()
    assert rows == [
        {"code": "best_prefix", "d": "least_busy", "th": None, "load": 0.0, "unc": 200, "n": 1},
        {"code": "load_guard", "d": "least_busy", "th": 2.0, "load": 3.0, "unc": 1000, "n": 2},
    ]


def _v1_batch() -> bytes:
    """An emitter batch as a version-1 router sent it: the requests schema without the v2 columns."""
    v2_only = {"routing_reason_code", "routing_decode_reason_code", "routing_threshold", "routing_load"}
    v2_only.add("uncached_tokens")
    schema = pa.schema(
        [f for f in SCHEMAS["requests"] if f.name not in v2_only and not f.name.startswith(("miss_", "transfer_tr"))]
    )
    now = pa.scalar(int(time.time() * 1e6), pa.timestamp("us", tz="UTC"))
    cols = {
        "event_id": ["old-1"],
        "event_time": pa.array([now.value], schema.field("event_time").type),
        "routing_reason": ["cache: p1 holds 800/1000 tokens, queue 0"],
        "prompt_tokens": [1000],
    }
    table = pa.table({f.name: cols.get(f.name, pa.nulls(1, f.type)) for f in schema}, schema=schema)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, schema) as w:
        w.write_table(table)
    return sink.getvalue()


def test_a_version_1_lake_still_answers_version_2_queries(r, prefix, make_writer, lake) -> None:
    r.xadd(f"{prefix}:requests", {"v": 1, "n": 1, "src": "old-router", "a": _v1_batch()})
    assert make_writer().drain().rows == 1
    only_v1 = query(lake, "SELECT routing_reason AS s, routing_reason_code AS c, uncached_tokens AS u FROM requests")
    assert only_v1.to_pylist() == [{"s": "cache: p1 holds 800/1000 tokens, queue 0", "c": None, "u": None}]
    # the writer conformed the old batch: its part file already has the v2 columns, as nulls
    assert query(lake, "SELECT count(*) AS n FROM requests WHERE routing_threshold IS NULL").to_pylist() == [{"n": 1}]


def test_part_files_written_before_version_2_read_with_the_new_columns_as_nulls(
    make_emitter, make_writer, lake
) -> None:
    old = pa.ipc.open_stream(_v1_batch()).read_all()
    pdir = lake / "requests" / "date=2026-11-30" / "hour=10"
    pdir.mkdir(parents=True)
    pq.write_table(old, pdir / "part-old.parquet")
    sql = "SELECT event_id, routing_reason_code AS code, uncached_tokens AS unc FROM requests ORDER BY event_id"
    assert query(lake, sql).to_pylist() == [{"event_id": "old-1", "code": None, "unc": None}]
    cache, _ = _two_decisions()
    cache.finish = time.time()
    e = make_emitter(start=False)
    e.emit("requests", {**request_record(cache, endpoint="chat", http_status=200), "event_id": "new-1"})
    e.flush()
    make_writer().drain()
    assert query(lake, sql).to_pylist() == [
        {"event_id": "new-1", "code": "best_prefix", "unc": 200},
        {"event_id": "old-1", "code": None, "unc": None},
    ]
