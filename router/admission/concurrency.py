"""How many requests one tenant may have in flight at once, per router process.

Requests/min and tokens/min (``ratelimit``) bound what a tenant asks for over time, not what it holds
now: a tenant could open hundreds of slow streams within its request rate and keep every node slot
busy for minutes. So each generation request also holds one of its tenant's stream slots, from
admission until the exchange lets go of everything it held (``router.edge.exchange``: answer done, error,
client gone, client stalled, server shutdown: the same one exit). Over the limit: 429
``rate_limit_exceeded`` naming the limit, before any node works.

Counted in this router process (a dict; no await between the check and the count, so no race on the
event loop): with N router replicas a tenant may hold up to N times its limit. Redis could count
across replicas, but a replica that dies would then leak its counts until they expired; the process
count dies with its streams.

Limits: ``AdmissionSettings.tenant_max_streams`` for every tenant (0 = unlimited), and
``tenant_max_streams_overrides`` per tenant id (the anonymous tenant of a cluster without auth too).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from contracts.errors import RateLimited

RETRY_AFTER_S = 1.0
"""Retry-After of a refusal: a slot frees when one of the tenant's streams ends, which cannot be known."""


class TenantStreams:
    def __init__(self, default_limit: int = 0, overrides: Mapping[str, int] | None = None) -> None:
        self.default_limit = default_limit
        self.overrides = dict(overrides or {})
        self._inflight: dict[str, int] = {}

    def limit(self, tenant_id: str) -> int:
        return self.overrides.get(tenant_id, self.default_limit)

    def inflight(self, tenant_id: str) -> int:
        return self._inflight.get(tenant_id, 0)

    def acquire(self, tenant_id: str) -> Callable[[], None]:
        """Take one of the tenant's slots (``RateLimited`` when all are taken). Returns the release,
        which is idempotent and never awaits (safe in a shielded exit or under cancellation)."""
        limit = self.limit(tenant_id)
        held = self._inflight.get(tenant_id, 0)
        if limit > 0 and held >= limit:
            raise RateLimited(
                f"too many concurrent requests: this key's tenant may have {limit} in flight at once; "
                "wait for one to finish",
                retry_after=RETRY_AFTER_S,
            )
        self._inflight[tenant_id] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self._inflight.get(tenant_id, 1) - 1
            if left > 0:
                self._inflight[tenant_id] = left
            else:
                self._inflight.pop(tenant_id, None)

        return release
