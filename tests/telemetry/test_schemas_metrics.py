"""Schemas are versioned and documented; metrics follow one request record."""

from __future__ import annotations

import pyarrow as pa

from telemetry.schemas import SCHEMA_VERSION, SCHEMAS, TABLE_NAMES, conform
from tests.telemetry.conftest import sample


def test_every_table_is_versioned_documented_and_has_id_and_time():
    assert set(SCHEMAS) == set(TABLE_NAMES)
    for name, schema in SCHEMAS.items():
        assert schema.metadata[b"tandem.schema_version"] == str(SCHEMA_VERSION).encode()
        assert schema.field("event_id").type == pa.string() and not schema.field("event_id").nullable
        assert pa.types.is_timestamp(schema.field("event_time").type)
        for f in schema:
            assert f.metadata and f.metadata.get(b"doc"), f"{name}.{f.name} has no doc"
    for f in (
        "fleet_cached_tokens",
        "routed_cached_tokens",
        "engine_cached_tokens",
        "transfer_bytes",
        "itl_p99_s",
    ):
        assert f in SCHEMAS["requests"].names


def test_conform_fills_fields_an_older_batch_lacks():
    old = pa.table({"event_id": ["a"], "event_time": pa.array([0], pa.timestamp("us", tz="UTC"))})
    t = conform(old, SCHEMAS["errors"])
    assert t.schema.names == SCHEMAS["errors"].names
    assert t.column("message").to_pylist() == [None]


def test_observe_request_updates_the_metrics(metrics):
    rec = {
        "model": "m",
        "status": "ok",
        "ttft_s": 0.2,
        "itl_mean_s": 0.02,
        "e2e_s": 3.0,
        "prompt_tokens": 1000,
        "completion_tokens": 50,
        "cached_tokens": 400,
        "fleet_cached_tokens": 800,
        "routed_cached_tokens": 600,
        "engine_cached_tokens": 400,
        "transfer_bytes": 10_000,
        "transfer_s": 0.03,
    }
    metrics.observe_request(rec)
    metrics.observe_request({**rec, "status": "error", "ttft_s": None})
    assert sample(metrics, "tandem_requests_total", model="m", status="ok") == 1
    assert sample(metrics, "tandem_requests_total", model="m", status="error") == 1
    assert sample(metrics, "tandem_ttft_seconds_count", model="m") == 1
    assert sample(metrics, "tandem_ttft_seconds_bucket", model="m", le="0.25") == 1
    assert sample(metrics, "tandem_hit_tokens_total", model="m", level="routed") == 1200
    assert sample(metrics, "tandem_tokens_total", model="m", kind="prompt") == 2000
    assert sample(metrics, "tandem_kv_transfer_bytes_total") == 20_000
    metrics.set_node_load("p0", "prefill", waiting=3, running=5)
    assert sample(metrics, "tandem_node_queue_depth", node="p0", role="prefill") == 3


def test_dashboard_uses_only_metrics_that_exist(metrics):
    import json
    import re
    from pathlib import Path

    from prometheus_client import generate_latest

    metrics.observe_request(
        {
            "model": "m",
            "status": "ok",
            "ttft_s": 1,
            "itl_mean_s": 1,
            "e2e_s": 1,
            "prompt_tokens": 1,
            "fleet_cached_tokens": 1,
            "transfer_s": 1,
            "transfer_bytes": 1,
        }
    )
    metrics.set_node_load("n", "prefill", waiting=1, running=1)
    metrics.dropped_events.labels("requests", "buffer_full").inc()
    metrics.sent_events.labels("requests").inc()
    metrics.lake_written_events.labels("requests").inc()
    exported = set(re.findall(r"^(tandem_\w+)", generate_latest(metrics.registry).decode(), re.M))
    dash = (Path(__file__).resolve().parents[2] / "infra" / "dashboards" / "tandem.json").read_text()
    used = set(re.findall(r"tandem_\w+", json.dumps(json.loads(dash))))
    assert used and used <= exported, used - exported
