"""Which tenants allowed their served conversations to leave as training data.

One row per tenant in ``tandem_export_consent`` (tenant_id, allowed 0/1, updated_at, note), in the
session store's database, set by ``tandem lake consent TENANT --allow|--deny``. No row means no
consent: a tenant is exported only after an operator recorded that it opted in. Consent is read when an
export runs; revoking it stops every later run, and granting it does not reach back past an export
name's watermark (start a new export name for that).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from telemetry.export.db import ExportDb

SCHEMA = """CREATE TABLE IF NOT EXISTS tandem_export_consent (
    tenant_id TEXT PRIMARY KEY,
    allowed INTEGER NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    note TEXT)"""

_UPSERT = """INSERT INTO tandem_export_consent (tenant_id, allowed, updated_at, note) VALUES ($1, $2, $3, $4)
    ON CONFLICT (tenant_id) DO UPDATE SET allowed = excluded.allowed, updated_at = excluded.updated_at,
    note = excluded.note"""


@dataclass(frozen=True, slots=True)
class Consent:
    tenant_id: str
    allowed: bool
    updated_at: float
    note: str | None


def init_schema(db: ExportDb) -> None:
    db.execute(SCHEMA)


def set_consent(db: ExportDb, tenant_id: str, allowed: bool, note: str | None = None) -> None:
    init_schema(db)
    db.execute(_UPSERT, tenant_id, int(allowed), time.time(), note)


def consents(db: ExportDb) -> list[Consent]:
    if not db.has_table("tandem_export_consent"):
        return []
    rows = db.fetch("SELECT tenant_id, allowed, updated_at, note FROM tandem_export_consent ORDER BY tenant_id")
    return [Consent(str(t), bool(a), float(u), n) for t, a, u, n in rows]


def allowed_tenants(db: ExportDb) -> frozenset[str]:
    return frozenset(c.tenant_id for c in consents(db) if c.allowed)
