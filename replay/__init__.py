"""Replaying a trace against a cluster over real SSE (``tandem replay``): ``plan`` turns a trace into
requests (rescaled to the context window, token-id prompts whose shared prefixes are the trace's),
``runner`` sends them open loop or closed loop per session, ``client`` times one streamed answer,
``results`` writes the Parquet results and the summary (observed hit rate next to the ceiling)."""

from replay.plan import PlannedRequest, Scaling, plan
from replay.results import RESULT_SCHEMA, summarize, to_table, write_results
from replay.runner import Mode, ReplaySettings, Result, run

__all__ = [
    "RESULT_SCHEMA",
    "Mode",
    "PlannedRequest",
    "ReplaySettings",
    "Result",
    "Scaling",
    "plan",
    "run",
    "summarize",
    "to_table",
    "write_results",
]
