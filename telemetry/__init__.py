"""Telemetry: event schemas (Arrow), the slow-path emitter, the Parquet lake writer, metrics, queries.

    Emitter / EmitterConfig      fast path -> bounded buffer -> Redis Streams (never blocks)
    LakeWriter / WriterConfig    Redis Streams -> Parquet lake, at least once, de-duplicated
    METRICS / TandemMetrics      every tandem_* Prometheus metric; observe_request(record)
    SCHEMAS / SCHEMA_VERSION     the tables' Arrow schemas
    connect / query              DuckDB over the lake

The report (``telemetry.report``, matplotlib) and the CLI apps (``telemetry.cli``) are imported on
their own so that serving processes do not load matplotlib.
"""

from telemetry.emitter import Emitter, EmitterConfig
from telemetry.lake_writer import LakeWriter, WriterConfig
from telemetry.metrics import METRICS, TandemMetrics, observe_request
from telemetry.query import connect, query
from telemetry.schemas import SCHEMA_VERSION, SCHEMAS, TABLE_NAMES

__all__ = [
    "METRICS",
    "SCHEMAS",
    "SCHEMA_VERSION",
    "TABLE_NAMES",
    "Emitter",
    "EmitterConfig",
    "LakeWriter",
    "TandemMetrics",
    "WriterConfig",
    "connect",
    "observe_request",
    "query",
]
