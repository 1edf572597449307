"""``tandem lake questions``: ready-made SQL for the questions researchers ask of the lake.

Each ``Question`` is one DuckDB statement over the lake's views (``telemetry.query.connect``) that runs
as printed: ``tandem lake query "$(tandem lake questions NAME --sql)"`` gives the same rows as
``tandem lake questions NAME --run``. Where a question is about one thing (a session, a turn), the
statement's first CTE, ``ask``, picks it, by default the most recent example in the lake; edit that
CTE to ask about another. The suite runs every statement against a lake written by the real lake
writer and requires rows (``tests/telemetry/test_questions.py``).

Shared definitions, as in ``telemetry.report``:
    reached an engine   ``decode_node IS NOT NULL AND status <> 'rejected'``; hit rates count only these
    turn                a session's n-th request that reached an engine, by arrival
    engine hit rate     sum(engine_cached_tokens) / sum(prompt_tokens)
"""

from __future__ import annotations

from dataclasses import dataclass

_TURNS = """turns AS (
    SELECT *, row_number() OVER (PARTITION BY session_id ORDER BY coalesce(t_arrival, event_time), event_id) AS turn
    FROM requests
    WHERE session_id IS NOT NULL AND decode_node IS NOT NULL AND coalesce(status, '') <> 'rejected'
)"""


@dataclass(frozen=True, slots=True)
class Question:
    name: str
    question: str
    sql: str


QUESTIONS: tuple[Question, ...] = (
    Question(
        "session_turn_miss",
        "Why did session X miss on turn N? (ask: by default the latest turn of the most recent session)",
        f"""WITH {_TURNS},
ask AS (  -- edit: SELECT 'my-session' AS session_id, 3 AS turn
    SELECT session_id, max(turn) AS turn FROM turns
    GROUP BY session_id ORDER BY max(coalesce(t_arrival, event_time)) DESC LIMIT 1
)
SELECT t.session_id, t.turn, t.prompt_tokens, t.engine_cached_tokens,
       t.fleet_cached_tokens, t.routed_cached_tokens, t.uncached_tokens,
       t.miss_cold_tokens, t.miss_evicted_tokens, t.miss_evicted_node, t.miss_evicted_ago_s,
       t.miss_elsewhere_tokens, t.miss_elsewhere_node, t.miss_elsewhere_reason, t.miss_undelivered_tokens,
       t.routing_reason_code, t.routing_threshold, t.routing_load,
       t.prefill_node, t.decode_node, t.routing_reason
FROM turns t JOIN ask USING (session_id, turn)""",
    ),
    Question(
        "hit_rate_by_tool_pause",
        "Hit rate by pause length: the time between a turn's end and the session's next request, "
        "after a tool call or not",
        f"""WITH {_TURNS},
paused AS (
    SELECT *,
        epoch(coalesce(t_arrival, event_time))
            - epoch(lag(t_finish) OVER (PARTITION BY session_id ORDER BY turn)) AS pause_s,
        lag(finish_reason) OVER (PARTITION BY session_id ORDER BY turn) = 'tool_calls' AS after_tool_call
    FROM turns
)
SELECT CASE WHEN pause_s < 1 THEN '0-1 s' WHEN pause_s < 5 THEN '1-5 s' WHEN pause_s < 30 THEN '5-30 s'
            WHEN pause_s < 120 THEN '30-120 s' ELSE '120 s+' END AS pause,
       coalesce(after_tool_call, false) AS after_tool_call,
       count(*) AS requests,
       round(sum(engine_cached_tokens) / nullif(sum(prompt_tokens), 0), 3) AS engine_hit_rate,
       round(sum(fleet_cached_tokens) / nullif(sum(prompt_tokens), 0), 3) AS fleet_hit_rate
FROM paused WHERE pause_s IS NOT NULL
GROUP BY 1, 2 ORDER BY min(pause_s), 2""",
    ),
    Question(
        "transfer_s_per_gb_by_transport",
        "KV transfer seconds per GB, by connector and transport",
        """SELECT coalesce(kv_connector, '?') AS connector, coalesce(transfer_transport, '?') AS transport,
       count(*) AS transfers, round(sum(transfer_bytes) / 1e9, 3) AS gb,
       round(sum(transfer_s) / nullif(sum(transfer_bytes) / 1e9, 0), 3) AS s_per_gb,
       round(quantile_cont(transfer_s, 0.5) * 1e3, 1) AS p50_ms
FROM requests
WHERE transfer_bytes > 0 AND transfer_s IS NOT NULL
GROUP BY 1, 2 ORDER BY 1, 2""",
    ),
    Question(
        "pd_vs_colocated_ttft_by_prompt_length",
        "P/D against colocated TTFT, by prompt length",
        """SELECT CASE WHEN prompt_tokens < 512 THEN '0-511' WHEN prompt_tokens < 2048 THEN '512-2047'
            WHEN prompt_tokens < 4096 THEN '2048-4095' ELSE '4096+' END AS prompt_tokens,
       routing_decision, count(*) AS requests,
       round(quantile_cont(ttft_s, 0.5) * 1e3, 1) AS ttft_p50_ms,
       round(quantile_cont(ttft_s, 0.99) * 1e3, 1) AS ttft_p99_ms
FROM requests
WHERE status = 'ok' AND ttft_s IS NOT NULL AND routing_decision IS NOT NULL
GROUP BY 1, 2 ORDER BY min(prompt_tokens), 2""",
    ),
    Question(
        "uncached_tokens_by_miss_kind",
        "Where did the uncached prompt tokens go: cold, evicted, elsewhere (and why), undelivered",
        """SELECT 'cold' AS kind, NULL AS why, sum(miss_cold_tokens) AS tokens FROM requests
UNION ALL SELECT 'evicted', NULL, sum(miss_evicted_tokens) FROM requests
UNION ALL SELECT 'elsewhere', coalesce(miss_elsewhere_reason, '?'), sum(miss_elsewhere_tokens) FROM requests
    WHERE miss_elsewhere_tokens > 0 GROUP BY 2
UNION ALL SELECT 'undelivered', NULL, sum(miss_undelivered_tokens) FROM requests
ORDER BY 1, 2""",
    ),
)

BY_NAME: dict[str, Question] = {q.name: q for q in QUESTIONS}


def catalogue() -> str:
    """Every question with its name and SQL, as ``tandem lake questions`` prints it."""
    parts = []
    for q in QUESTIONS:
        parts.append(f"-- {q.name}: {q.question}\n{q.sql};\n")
    return "\n".join(parts)
