"""Request traces: the versioned Parquet format (``schema``), chained block hashes that regroup into
any block size (``hashing``), importers (``mooncake``, ``lake``), the agentic generator (``synth``)
and what a trace holds, its cache-hit ceiling included (``stats``). ``tandem trace ...`` is ``cli``."""

from traces.hashing import TraceError, block_token_ids, regroup
from traces.schema import SCHEMA_VERSION, TRACE_SCHEMA, Trace, TraceMeta, make_trace, read_trace, write_trace
from traces.stats import Ceiling, ceiling, per_request_ceiling, trace_stats

__all__ = [
    "SCHEMA_VERSION",
    "TRACE_SCHEMA",
    "Ceiling",
    "Trace",
    "TraceError",
    "TraceMeta",
    "block_token_ids",
    "ceiling",
    "make_trace",
    "per_request_ceiling",
    "read_trace",
    "regroup",
    "trace_stats",
    "write_trace",
]
