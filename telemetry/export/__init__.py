"""Served conversations to a training set: ``tandem lake export``.

Joins the session store's turns (what was said, tool calls and their results, in the order served) with
the lake's request rows (outcome, timings, hit figures) and feedback, keeps what consent and the
operator's filters allow, passes every example through the redaction hook, and writes chat-jsonl
(OpenAI fine-tuning shape), preference-jsonl (OpenAI DPO shape) or Parquet to a folder or an fsspec URI
(``s3://`` included), exactly once per export name (a watermark committed with a manifest of the parts).

    source ─► filters (consent) ─► redact ─► formats ─► sink ─► watermark         (run: the pipeline)
"""

from telemetry.export.consent import allowed_tenants, consents, set_consent
from telemetry.export.filters import FeedbackFilter, Filters
from telemetry.export.formats import Format, PairRule
from telemetry.export.run import ExportResult, ExportSpec, run_export
from telemetry.export.settings import ExportSettings

__all__ = [
    "ExportResult",
    "ExportSettings",
    "ExportSpec",
    "FeedbackFilter",
    "Filters",
    "Format",
    "PairRule",
    "allowed_tenants",
    "consents",
    "run_export",
    "set_consent",
]
