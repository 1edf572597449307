"""The export's view for ``tandem lake report``: per export name what was written (parts, rows, the
watermark's age) and what its latest run kept and left out (examples per tenant, feedback coverage,
rows filtered by reason), and which tenants consented. Read from the session store's database, where
the runs record it; no store (or no export yet) is an empty view, never an error."""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.errors import ConfigError, StoreError
from telemetry.export import watermark as wmk
from telemetry.export.consent import Consent, consents
from telemetry.export.db import open_db
from telemetry.export.settings import ExportSettings


@dataclass(frozen=True, slots=True)
class ExportLine:
    name: str
    format: str
    parts: int
    rows: int
    updated_at: float | None
    last_run_rows: int = 0
    per_tenant: dict[str, int] = field(default_factory=dict)
    filtered: dict[str, int] = field(default_factory=dict)
    examples: int = 0
    rated: int = 0

    @property
    def feedback_coverage(self) -> float | None:
        """Share of the latest run's kept examples that carry feedback."""
        return self.rated / self.examples if self.examples else None


@dataclass(frozen=True, slots=True)
class ExportView:
    exports: list[ExportLine]
    consents: list[Consent]
    error: str | None = None
    """Why the store could not be read, if it could not."""


def export_view(settings: ExportSettings) -> ExportView:
    try:
        db = open_db(settings.store_url(), create=False)
    except (StoreError, ConfigError) as exc:
        return ExportView([], [], str(exc))
    try:
        runs = {r[0]: r for r in wmk.last_runs(db)}
        lines = []
        for w in wmk.watermarks(db):
            s = runs[w.name][5] if w.name in runs else {}
            lines.append(
                ExportLine(
                    name=w.name,
                    format=w.format,
                    parts=w.parts,
                    rows=w.rows,
                    updated_at=w.updated_at,
                    last_run_rows=int(s.get("rows", 0)),
                    per_tenant=dict(s.get("per_tenant", {})),
                    filtered=dict(s.get("filtered", {})),
                    examples=int(s.get("examples", 0)),
                    rated=int(s.get("rated", 0)),
                )
            )
        return ExportView(lines, consents(db))
    except StoreError as exc:
        return ExportView([], [], str(exc))
    finally:
        db.close()
