"""Who a router serves while Redis cannot say (``store_outage_grace_s``): a Redis restart should be no
outage for clients, and a revoked key should work for a bounded time at most.

    a key Redis confirmed within the grace            ─▶ its tenant, no limit charged
    auth seen off within the grace                    ─▶ anonymous, no limit charged
    neither, auth not on for good, grace above 0      ─▶ ask the key store whether any key exists:
                                                           none ─▶ anonymous (auth counts as seen off now)
    anything else                                     ─▶ 503 + Retry-After

The key store is asked only by a router with no recent word of its own (it served nobody within the
grace). Requests that meet the outage together share one ask, each ask is bounded by
``STORE_CHECK_S``, and after a failed one the store is left alone that long: a PostgreSQL that is down
too sees one query per period, not one per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from contracts.errors import StoreError, Unavailable
from router.admission.key_records import bearer_token, hash_key

if TYPE_CHECKING:
    from router.admission.keys import Tenant

log = logging.getLogger("tandem.router.keys")


class OutageGrace:
    MAX_CONFIRMED = 100_000
    STORE_CHECK_S = 2.0
    """How long an ask of the key store may take, and how long the store is then left alone."""

    def __init__(
        self,
        grace_s: float,
        anonymous: Tenant,
        *,
        auth_on: Callable[[], bool],
        store_has_keys: Callable[[], Awaitable[bool]],
    ) -> None:
        self.grace_s = grace_s
        """0: refuse everything while the store is unreachable."""
        self.anonymous = anonymous
        self._auth_on = auth_on
        """Whether auth is on for good in this process (required, or a key was ever seen)."""
        self._store_has_keys = store_has_keys
        self.admissions = 0
        """Requests admitted on this module's word (no rate limit charged)."""
        self._confirmed: OrderedDict[str, tuple[Tenant, float]] = OrderedDict()
        """Key hash → (its tenant, when Redis last confirmed it)."""
        self._auth_off_at: float | None = None
        self._logged_at = 0.0
        self._store_check_after = 0.0
        """Monotonic time before which the key store is not asked again (its last ask failed)."""
        self._store_check: asyncio.Future[bool] | None = None
        """The ask under way, which every request meanwhile awaits."""

    # -- what Redis said while it could -----------------------------------------------------------
    def confirmed(self, authorization: str | None, tenant: Tenant) -> None:
        """Redis vouched for this header's key just now."""
        token = bearer_token(authorization)
        if token is None:
            return
        key_hash = hash_key(token)
        self._confirmed[key_hash] = (tenant, time.monotonic())
        self._confirmed.move_to_end(key_hash)
        if len(self._confirmed) > self.MAX_CONFIRMED:
            self._confirmed.popitem(last=False)

    def auth_off(self) -> None:
        """Auth was confirmed off just now."""
        self._auth_off_at = time.monotonic()

    # -- while it cannot --------------------------------------------------------------------------
    def during(self, authorization: str | None) -> Tenant | None:
        """Who this header is while Redis cannot say: the tenant Redis confirmed for its key within the
        grace, or anonymous if auth was off that recently; None when nobody can vouch."""
        now = time.monotonic()
        token = bearer_token(authorization)
        if token is not None:
            seen = self._confirmed.get(hash_key(token))
            if seen is not None and now - seen[1] <= self.grace_s:
                return seen[0]
        off = self._auth_off_at
        if not self._auth_on() and off is not None and now - off <= self.grace_s:
            return self.anonymous
        return None

    async def vouch(self, authorization: str | None, exc: Exception) -> Tenant:
        """The tenant to serve while the store fails with ``exc`` (see the module docstring), else 503."""
        tenant = self.during(authorization)
        if tenant is None and await self._auth_off_in_store():
            tenant = self.anonymous
        now = time.monotonic()
        if now - self._logged_at > 10:
            self._logged_at = now
            log.warning(
                "key store unreachable (%s): serving keys confirmed in the last %g s, without limits",
                exc,
                self.grace_s,
            )
        if tenant is None:
            raise Unavailable(
                "the key store is unreachable and this request's key cannot be verified now", retry_after=5
            )
        self.admissions += 1
        return tenant

    async def _auth_off_in_store(self) -> bool:
        """Whether the key store itself says auth is off (one ask at a time; see the module docstring)."""
        if self._auth_on() or self.grace_s <= 0 or time.monotonic() < self._store_check_after:
            return False
        if self._store_check is None:
            self._store_check = check = asyncio.ensure_future(self._ask_store())
            check.add_done_callback(self._store_check_done)
        return await asyncio.shield(self._store_check)

    async def _ask_store(self) -> bool:
        try:
            has_keys = await asyncio.wait_for(self._store_has_keys(), self.STORE_CHECK_S)
        except (StoreError, OSError, TimeoutError) as exc:
            self._store_check_after = time.monotonic() + self.STORE_CHECK_S
            log.warning("key store unreachable too (%s): requests without a confirmed key get 503", exc)
            return False
        if has_keys:
            return False
        self.auth_off()
        return True

    def _store_check_done(self, check: asyncio.Future[bool]) -> None:
        self._store_check = None
        if not check.cancelled():
            check.exception()  # retrieved here too: every request waiting on it may have left
