"""The two priority classes. Kept apart from ``priority`` so that keys and limits can name a class
without importing the admission controller."""

from __future__ import annotations

import enum

from contracts.errors import InvalidRequest

PRIORITY_HEADER = "x-tandem-priority"


class Priority(enum.StrEnum):
    INTERACTIVE = "interactive"
    """Default. A person or an agent is waiting on the answer."""
    BATCH = "batch"
    """Throughput work: queued behind interactive and shed first under overload."""

    @property
    def rank(self) -> int:
        """Lower is served first."""
        return 0 if self is Priority.INTERACTIVE else 1


def resolve_priority(tenant_priority: Priority, header: str | None) -> Priority:
    """The class a request runs in: the tenant's class, lowered by the ``x-tandem-priority`` header.

    A header may only lower the class (an interactive tenant marks a background job ``batch``); a batch
    tenant asking for ``interactive`` stays ``batch``, otherwise the header would defeat shedding.
    """
    if header is None or header == "":
        return tenant_priority
    try:
        asked = Priority(header.strip().lower())
    except ValueError as exc:
        raise InvalidRequest(
            f"{PRIORITY_HEADER} must be 'interactive' or 'batch', not {header!r}", param=PRIORITY_HEADER
        ) from exc
    return asked if asked.rank >= tenant_priority.rank else tenant_priority
