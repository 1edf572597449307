"""What an export keeps: consent first, then the operator's filters, each refusal counted by its reason.

Checked in this order, the first that refuses names the reason (``Filtered`` counts them for the run's
summary and ``tandem lake report``):

    no_consent   the tenant has no ``allowed`` row in ``tandem_export_consent`` (``consent``)
    tenant       ``--tenant`` names others
    model        ``--model`` names others (the served model that answered)
    time         the turn ended before ``--since`` (``--until`` bounds the read itself)
    empty        the turn has no answer to learn from (no text and no tool call)
    failed       the lake says the request ended ``error`` or ``cancelled``, and ``--include-failed`` was
                 not given; with it such a turn is kept and its metadata says ``failed: true``
    feedback     ``--feedback rated|unrated`` or ``--min-rating`` / ``--max-rating`` refuse it
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from telemetry.export.source import Example

FAILED_STATUSES = frozenset({"error", "cancelled"})


class FeedbackFilter(enum.StrEnum):
    ANY = "any"
    RATED = "rated"
    UNRATED = "unrated"


@dataclass(frozen=True, slots=True)
class Filters:
    tenants: frozenset[str] = frozenset()
    """Empty: every consenting tenant."""
    models: frozenset[str] = frozenset()
    """Empty: every model."""
    since: float | None = None
    until: float | None = None
    feedback: FeedbackFilter = FeedbackFilter.ANY
    min_rating: int | None = None
    max_rating: int | None = None
    include_failed: bool = False

    def reason(self, ex: Example, consented: frozenset[str]) -> str | None:
        """Why ``ex`` is left out, or None if it is kept."""
        if ex.tenant_id not in consented:
            return "no_consent"
        if self.tenants and ex.tenant_id not in self.tenants:
            return "tenant"
        if self.models and (ex.model or "") not in self.models:
            return "model"
        if self.since is not None and ex.created_at < self.since:
            return "time"
        if not ex.response or not (ex.response.get("content") or ex.response.get("tool_calls")):
            return "empty"
        if ex.status in FAILED_STATUSES and not self.include_failed:
            return "failed"
        rating = ex.feedback.rating if ex.feedback else None
        wants_rating = self.min_rating is not None or self.max_rating is not None
        if self.feedback is FeedbackFilter.RATED or wants_rating:
            if rating is None:
                return "feedback"
        if self.feedback is FeedbackFilter.UNRATED and ex.feedback is not None:
            return "feedback"
        if rating is not None and self.min_rating is not None and rating < self.min_rating:
            return "feedback"
        if rating is not None and self.max_rating is not None and rating > self.max_rating:
            return "feedback"
        return None


def is_failed(ex: Example) -> bool:
    return ex.status in FAILED_STATUSES


def apply(
    examples: Iterable[Example], filters: Filters, consented: frozenset[str]
) -> tuple[list[Example], Counter[str]]:
    """The examples kept, and how many each reason left out."""
    kept: list[Example] = []
    dropped: Counter[str] = Counter()
    for ex in examples:
        why = filters.reason(ex, consented)
        if why is None:
            kept.append(ex)
        else:
            dropped[why] += 1
    return kept, dropped
