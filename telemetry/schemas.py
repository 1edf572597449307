"""Arrow schemas of the telemetry tables: the one definition the emitters, the lake writer and the
queries share.

Tables (one Redis Stream and one lake folder each):

    requests     one row per finished request (ok, error or cancelled): timings, tokens, the routing
                 decision and the hit-rate breakdown, the KV transfer, the outcome
    tool_calls   one row per tool call an answer contains
    feedback     one row per ``POST /v1/feedback``
    errors       one row per error a component reports (router, prefill, decode, kv_transfer, ...)
    kv_events    one row per node per aggregation interval: KV blocks stored / removed / cleared
    host_tier    one row per host tier per interval: what it holds at the interval's end (blocks by
                 state, pinned bytes) and what happened in it (stored, hits, pinned hits, evictions
                 and forgotten blocks by reason, refused pins, demotions, reclaimed reservations)

Every table starts with the common columns

    event_id     string     unique id of the event (uuid4 hex unless the caller gives one); the lake
                            writer de-duplicates on it, so re-sending an event must keep its id
    event_time   timestamp  when the event happened (UTC, microseconds); the lake partition
                            (date=YYYY-MM-DD/hour=HH) is taken from it
    source       string     the emitting process (e.g. ``router-0``, ``prefill-1``)

Each field carries its documentation in the Arrow field metadata (key ``doc``), and each schema
carries ``tandem.table`` and ``tandem.schema_version``; ``describe(table)`` prints them. Durations
are float seconds; instants are timestamps; token counts are int64.

Emitters give timestamps as float epoch seconds (``time.time()``) or ``datetime``; the emitter's
flusher converts them. The Parquet files do not contain the ``date``/``hour`` partition columns:
DuckDB adds them from the path (hive partitioning).

Versions (bump ``SCHEMA_VERSION`` on any change; only add nullable fields, never rename or retype,
so that old parts stay readable; the lake writer conforms older batches to the current schema by
filling added fields with nulls):

    1  first version (this file).
    2  requests: routing decisions as data (routing_reason_code, routing_decode_reason_code,
       routing_threshold, routing_load, uncached_tokens); routing_reason stays, as display text;
       transfer_transport; miss attribution (miss_cold_tokens, miss_evicted_tokens, miss_evicted_node,
       miss_evicted_tier, miss_evicted_ago_s, miss_elsewhere_tokens, miss_elsewhere_node,
       miss_elsewhere_reason, miss_undelivered_tokens: router.kv_index.attribution).
    3  requests: requested_model (the client's ``model``: an alias, a canary name or a served name) and
       model_resolution (direct, alias, canary, fallback: router.model_table); ``model`` is now the
       served model that answered.
    4  requests: where the reused prompt tokens came from (local_cached_tokens, host_tier_cached_tokens,
       peer_cached_tokens: router.kv_index.attribution).
    5  host_tier: a new table, one row per host tier per interval (host_tier.lake).
    6  requests: api, the API the client spoke (chat, completions, responses, messages: router.edge.codecs).
    7  requests: transport, how the request came (http, or websocket: router.edge.codecs.websocket).
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 7

TS = pa.timestamp("us", tz="UTC")


def _f(name: str, typ: pa.DataType, doc: str, *, nullable: bool = True) -> pa.Field:
    return pa.field(name, typ, nullable=nullable, metadata={"doc": doc})


_COMMON = [
    _f("event_id", pa.string(), "Unique event id; the lake de-duplicates on it.", nullable=False),
    _f("event_time", TS, "When the event happened (UTC); decides the lake partition.", nullable=False),
    _f("source", pa.string(), "Emitting process, e.g. router-0 or prefill-1."),
]

_REQUESTS = [
    _f("request_id", pa.string(), "Router-assigned request id."),
    _f("response_id", pa.string(), "OpenAI response id returned to the client (chatcmpl-...)."),
    _f("session_id", pa.string(), "Agent session id (header or derived), null if none."),
    _f("tenant_id", pa.string(), "Tenant owning the API key."),
    _f("model", pa.string(), "Served model that answered (after alias, canary, fallback); '(unknown)' if none."),
    _f("requested_model", pa.string(), "The client's model: a served name, an alias or a canary name."),
    _f("model_resolution", pa.string(), "How model came from requested_model: direct, alias, canary, fallback."),
    _f("endpoint", pa.string(), "The route: chat, completions, responses or messages."),
    _f("api", pa.string(), "The API the client spoke: chat, completions, responses or messages."),
    _f("stream", pa.bool_(), "True if the client asked for SSE streaming."),
    _f("transport", pa.string(), "How the request came: http (JSON or SSE) or websocket (a socket message)."),
    _f("prefill_node", pa.string(), "Node that ran the prefill; null when decode prefilled itself."),
    _f("decode_node", pa.string(), "Node that decoded."),
    _f("t_arrival", TS, "Request received by the router."),
    _f("t_routed", TS, "Routing decision taken."),
    _f("t_prefill_start", TS, "Prefill request sent to the prefill node."),
    _f("t_prefill_end", TS, "Prefill node answered (its KV is ready to move)."),
    _f("t_transfer_start", TS, "First KV block left the prefill node."),
    _f("t_transfer_end", TS, "Last KV block arrived at the decode node."),
    _f("t_first_token", TS, "First token sent to the client."),
    _f("t_finish", TS, "Last byte sent to the client (or the request failed)."),
    _f("ttft_s", pa.float64(), "Time to first token, seconds (t_first_token - t_arrival)."),
    _f("itl_mean_s", pa.float64(), "Mean inter-token latency, seconds."),
    _f("itl_p99_s", pa.float64(), "99th percentile inter-token latency within this request, seconds."),
    _f("e2e_s", pa.float64(), "End-to-end latency, seconds (t_finish - t_arrival)."),
    _f("prompt_tokens", pa.int64(), "Prompt tokens (the router's tokenization, equal to the engine's)."),
    _f("completion_tokens", pa.int64(), "Generated tokens."),
    _f("cached_tokens", pa.int64(), "Prompt tokens served from cache, as reported to the client (usage)."),
    _f("routing_policy", pa.string(), "Name of the routing policy that decided (e.g. cache_aware)."),
    _f("routing_decision", pa.string(), "pd (prefill then transfer), colocated, or decode_only."),
    _f("routing_reason", pa.string(), "The routing decision in a sentence, for display; group by routing_reason_code."),
    _f(
        "routing_reason_code",
        pa.string(),
        "Why the node that prefilled was chosen (router.policies.ReasonCode): best_prefix, load_guard, "
        "session_affinity, local_prefill, prefill_saturated, least_loaded, round_robin, forced_pd, pinned. (v2)",
    ),
    _f(
        "routing_decode_reason_code",
        pa.string(),
        "Why the decode node was chosen: session_affinity, most_cached, least_busy, ... (v2)",
    ),
    _f("routing_threshold", pa.float64(), "The threshold the reason code's rule compared against, if any. (v2)"),
    _f("routing_load", pa.float64(), "The load figure the reason code's rule compared (see ReasonCode). (v2)"),
    _f(
        "uncached_tokens",
        pa.int64(),
        "Prompt tokens the engine that prefilled computed (prompt_tokens - engine_cached_tokens); the four "
        "miss_*_tokens sum to it. (v2)",
    ),
    _f("miss_cold_tokens", pa.int64(), "Uncached tokens never in the fleet (within the eviction history). (v2)"),
    _f("miss_evicted_tokens", pa.int64(), "Uncached tokens the fleet had held and evicted before this request. (v2)"),
    _f("miss_evicted_node", pa.string(), "Node that last held the evicted block breaking the prefix. (v2)"),
    _f(
        "miss_evicted_tier",
        pa.string(),
        "Where it was evicted from: the KV event's medium (GPU: the engine's cache), or cleared, events_lost, "
        "node_left. (v2)",
    ),
    _f("miss_evicted_ago_s", pa.float64(), "Seconds between that eviction and this request's routing. (v2)"),
    _f("miss_elsewhere_tokens", pa.int64(), "Uncached tokens another node held when this request was routed. (v2)"),
    _f("miss_elsewhere_node", pa.string(), "The node that held them. (v2)"),
    _f(
        "miss_elsewhere_reason",
        pa.string(),
        "Why the request went elsewhere: the routing reason code (load_guard, best_prefix, ...) or node_down. (v2)",
    ),
    _f(
        "miss_undelivered_tokens",
        pa.int64(),
        "Uncached tokens the routed node held per the router's index that its engine did not reuse. (v2)",
    ),
    _f(
        "local_cached_tokens",
        pa.int64(),
        "Reused prompt tokens from the prefilling engine's own cache (engine_cached_tokens split by the router's "
        "index: router.kv_index.attribution). (v4)",
    ),
    _f("host_tier_cached_tokens", pa.int64(), "Reused prompt tokens the engine loaded from its host tier. (v4)"),
    _f("peer_cached_tokens", pa.int64(), "Reused prompt tokens fetched from another node (not built yet: 0). (v4)"),
    _f(
        "fleet_cached_tokens",
        pa.int64(),
        "Longest prefix (tokens) of this prompt cached anywhere in the fleet at routing time.",
    ),
    _f(
        "routed_cached_tokens",
        pa.int64(),
        "Prefix (tokens) cached on the node the request was routed to, per the router's index.",
    ),
    _f(
        "engine_cached_tokens",
        pa.int64(),
        "Prefix tokens the engine confirms it reused (vLLM num_cached_tokens).",
    ),
    _f("transfer_bytes", pa.int64(), "KV bytes moved from prefill to decode node."),
    _f("transfer_s", pa.float64(), "KV transfer time, seconds."),
    _f("transfer_transport", pa.string(), "Transport the KV moved over (shm, tcp, ipc, ucx; nixl's own). (v2)"),
    _f("kv_connector", pa.string(), "KV connector used (tandem, nixl, none)."),
    _f("num_tool_calls", pa.int64(), "Tool calls in the answer."),
    _f("finish_reason", pa.string(), "stop, length, tool_calls, cancelled, error."),
    _f("status", pa.string(), "ok, error, cancelled (client went away), rejected (4xx/429/503)."),
    _f("http_status", pa.int64(), "HTTP status returned to the client."),
    _f("error_type", pa.string(), "Error class name when status is not ok."),
    _f("error_message", pa.string(), "Error message when status is not ok (truncated by the emitter)."),
]

_TOOL_CALLS = [
    _f("request_id", pa.string(), "Request whose answer contains the call."),
    _f("response_id", pa.string(), "OpenAI response id."),
    _f("session_id", pa.string(), "Agent session id."),
    _f("tenant_id", pa.string(), "Tenant."),
    _f("model", pa.string(), "Model that produced the call."),
    _f("call_index", pa.int64(), "Position of the call in the answer, from 0."),
    _f("tool_call_id", pa.string(), "Tool call id (call_...)."),
    _f("tool_name", pa.string(), "Function name."),
    _f("arguments", pa.string(), "Arguments JSON as produced by the model."),
    _f("arguments_valid_json", pa.bool_(), "True if the arguments parse as JSON."),
]

_FEEDBACK = [
    _f("response_id", pa.string(), "Response the feedback is about (must exist; else 404)."),
    _f("request_id", pa.string(), "Request behind that response."),
    _f("session_id", pa.string(), "Agent session id."),
    _f("tenant_id", pa.string(), "Tenant giving the feedback."),
    _f("rating", pa.int64(), "Rating as given by the client (e.g. -1/1 or 1..5)."),
    _f("comment", pa.string(), "Optional free text."),
    _f("labels", pa.list_(pa.string()), "Optional labels."),
]

_ERRORS = [
    _f("component", pa.string(), "router, prefill, decode, kv_transfer, lake_writer, ..."),
    _f("node_id", pa.string(), "Node where it happened, if any."),
    _f("request_id", pa.string(), "Request concerned, if any."),
    _f("session_id", pa.string(), "Agent session id, if any."),
    _f("tenant_id", pa.string(), "Tenant, if any."),
    _f("error_type", pa.string(), "Tandem error class name (contracts.errors), or the foreign type."),
    _f("error_code", pa.string(), "Machine-readable code, e.g. rate_limit_exceeded."),
    _f("http_status", pa.int64(), "HTTP status if the error reached a client."),
    _f("message", pa.string(), "Message (truncated by the emitter)."),
]

_KV_EVENTS = [
    _f("node_id", pa.string(), "Node whose engine published the KV events."),
    _f("role", pa.string(), "prefill, decode or both."),
    _f("interval_start", TS, "Start of the aggregation interval."),
    _f("interval_end", TS, "End of the aggregation interval."),
    _f("blocks_stored", pa.int64(), "BlockStored blocks in the interval."),
    _f("blocks_removed", pa.int64(), "BlockRemoved blocks in the interval."),
    _f("all_blocks_cleared", pa.int64(), "AllBlocksCleared events in the interval."),
    _f("num_events", pa.int64(), "Raw engine events aggregated into this row."),
    _f("kv_usage", pa.float64(), "KV cache usage 0..1 at interval end, if known."),
]

_HOST_TIER = [
    _f("tier_id", pa.string(), "The tier: <host>:<its shared file> (one tier per host and block layout). (v5)"),
    _f("host", pa.string(), "Host the tier serves. (v5)"),
    _f("model", pa.string(), "Model whose block layout the tier holds. (v5)"),
    _f("layout_fingerprint", pa.string(), "Hex fingerprint of the block layout (host_tier.layout). (v5)"),
    _f("interval_start", TS, "Start of the interval the deltas cover. (v5)"),
    _f("interval_end", TS, "End of the interval; the gauges are taken here. (v5)"),
    _f("slots", pa.int64(), "Slots the tier has: its bound, in blocks. (v5)"),
    _f("slot_bytes", pa.int64(), "Bytes of one block. (v5)"),
    _f("blocks_held", pa.int64(), "Blocks held (readable) at interval end. (v5)"),
    _f("blocks_writing", pa.int64(), "Slots reserved and being written at interval end. (v5)"),
    _f("blocks_pinned", pa.int64(), "Held blocks pinned by session retention at interval end. (v5)"),
    _f("pinned_bytes", pa.int64(), "Bytes pinned at interval end (blocks_pinned * slot_bytes). (v5)"),
    _f("stored", pa.int64(), "Blocks offloaded into the tier in the interval. (v5)"),
    _f("hits", pa.int64(), "Blocks lookups found in the interval. (v5)"),
    _f("misses", pa.int64(), "Blocks lookups did not find in the interval (a prefix lookup counts its first). (v5)"),
    _f(
        "pinned_hits",
        pa.int64(),
        "Hits on pinned blocks in the interval: context session retention kept (hits saved). (v5)",
    ),
    _f("evicted_lru", pa.int64(), "Unpinned blocks evicted, least recently used first. (v5)"),
    _f("evicted_pinned_lru", pa.int64(), "Pinned blocks evicted (no unpinned block was left). (v5)"),
    _f("evicted_other", pa.string(), "Evictions for any other reason, JSON {reason: blocks}; null if none. (v5)"),
    _f("forgotten_corrupt", pa.int64(), "Blocks dropped because a reader found them corrupt. (v5)"),
    _f("forgotten_other", pa.string(), "Blocks dropped for another reason, JSON {reason: blocks}; null if none. (v5)"),
    _f("pins_refused", pa.int64(), "Blocks a pin asked for beyond its tenant's budget. (v5)"),
    _f("demoted", pa.int64(), "Superseded blocks of a session, unpinned and sent to the cold end. (v5)"),
    _f("reclaimed", pa.int64(), "Reservations taken back from writers that vanished. (v5)"),
]

TABLE_NAMES: tuple[str, ...] = ("requests", "tool_calls", "feedback", "errors", "kv_events", "host_tier")


def _schema(table: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(
        _COMMON + fields,
        metadata={"tandem.table": table, "tandem.schema_version": str(SCHEMA_VERSION)},
    )


SCHEMAS: dict[str, pa.Schema] = {
    "requests": _schema("requests", _REQUESTS),
    "tool_calls": _schema("tool_calls", _TOOL_CALLS),
    "feedback": _schema("feedback", _FEEDBACK),
    "errors": _schema("errors", _ERRORS),
    "kv_events": _schema("kv_events", _KV_EVENTS),
    "host_tier": _schema("host_tier", _HOST_TIER),
}

TIMESTAMP_FIELDS: dict[str, tuple[str, ...]] = {
    t: tuple(f.name for f in s if pa.types.is_timestamp(f.type)) for t, s in SCHEMAS.items()
}


def schema_for(table: str) -> pa.Schema:
    """The current schema of ``table``; ``KeyError`` if there is no such table."""
    return SCHEMAS[table]


def describe(table: str) -> str:
    """One line per field: name, type, documentation."""
    lines = [f"{table} (schema version {SCHEMA_VERSION})"]
    for f in SCHEMAS[table]:
        doc = (f.metadata or {}).get(b"doc", b"").decode()
        lines.append(f"  {f.name:<22} {str(f.type):<22} {doc}")
    return "\n".join(lines)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Return ``table`` with exactly ``schema``'s columns: missing ones (batches written under an older
    schema version) become nulls, extra ones are dropped, types are cast."""
    if table.schema.equals(schema, check_metadata=False):
        return table.replace_schema_metadata(schema.metadata)
    cols = []
    for f in schema:
        idx = table.schema.get_field_index(f.name)
        if idx < 0:
            cols.append(pa.nulls(table.num_rows, f.type))
        else:
            col = table.column(idx)
            cols.append(col if col.type == f.type else col.cast(f.type))
    return pa.Table.from_arrays(cols, schema=schema)
