"""Auth off, known without asking Redis on every request: the admission fast path's lease.

While auth is off (no API key exists and ``TANDEM_AUTH=auto``) and no limit applies to anonymous
requests (global and anonymous requests/min and tokens/min all 0), the admission round trip (one
EVALSHA per request, ``router.admission.ratelimit``) can only answer "anonymous, nothing charged".
Skipping it, with the response index's writes batched (``router.record.responses``), took the
router from 4.79 to 4.53 ms of CPU per request with a CPU engine on the same cores (``tandem bench
overhead``'s load, three alternated runs each, a 2-core Xeon host). So once Redis and
the key store have confirmed auth off, the router reuses that answer for up to ``lease_s``
(``TANDEM_AUTH_OFF_LEASE_S``, 1 s; 0 turns this off), and asks again after it.

A key created anywhere ends the lease at once where it can be told:

- ``KeyStore.create_key`` publishes on ``<prefix>keys:changed`` after writing the auth flag; every
  router listens there (``listen``), and a message ends its lease. Redis delivers a message to the
  subscribers before it answers the publisher, so a request sent after ``tandem keys create`` returned
  finds the router told, unless both arrive within one turn of its event loop.
- In the creating process itself, every lease on the same prefix ends before ``create_key`` returns.
- An "auth off" answer that was on its way when a lease ended grants none: each end starts a new
  ``epoch``, and an answer grants a lease only under the epoch it was asked in.

No lease is granted while the subscription is not live (before it is confirmed, after an error, while
Redis is away): then every request asks Redis, as it did before. Whatever a message could not tell
(a flag written by hand, a subscription that died silently) is bounded by ``lease_s``: a key turns auth
on within that long on every router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("tandem.router.keys")

LEASE_S = 1.0
"""How long an "auth off" answer is reused without asking Redis again (``AdmissionSettings.auth_off_lease_s``)."""
RETRY_S = 1.0
"""Wait before subscribing again after the subscription failed."""

_leases: weakref.WeakSet[AuthOffLease] = weakref.WeakSet()
"""Every lease of this process: ``create_key`` ends those on its prefix before it returns."""


def keys_changed_channel(prefix: str) -> str:
    return f"{prefix}keys:changed"


class AuthOffLease:
    """Whether "auth off" may be assumed now, and the subscription that ends it."""

    def __init__(self, prefix: str, lease_s: float = LEASE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.prefix = prefix
        self.lease_s = lease_s
        self._clock = clock
        self._granted_at: float | None = None
        self.live = False
        """The subscription is confirmed: a key created elsewhere would be told here."""
        self.ended = 0
        """Leases ended by a message or by a key created in this process."""
        self.epoch = 0
        """Counts every end: an answer asked for before one (``grant(epoch)``) grants nothing."""
        self._task: asyncio.Task[None] | None = None
        _leases.add(self)

    def valid(self) -> bool:
        granted = self._granted_at
        return self.live and granted is not None and self._clock() - granted < self.lease_s

    def grant(self, epoch: int) -> None:
        """Redis and the store confirmed auth off in answer to a question asked at ``epoch``: reuse that
        for ``lease_s`` (if listening), unless a key was announced while the answer was on its way."""
        if self.live and self.lease_s > 0 and epoch == self.epoch:
            self._granted_at = self._clock()

    def end(self) -> None:
        self.epoch += 1
        if self._granted_at is not None:
            self.ended += 1
        self._granted_at = None

    @staticmethod
    def key_created(prefix: str) -> None:
        """A key was created by this process: every lease on ``prefix`` here ends now."""
        for lease in list(_leases):
            if lease.prefix == prefix:
                lease.end()

    # -- the subscription ------------------------------------------------------------------------------
    def listen(self, redis: aioredis.Redis) -> None:
        """Start listening for created keys (a router's start; ``aclose`` stops it)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._listen(redis), name="auth-off-lease")

    async def _listen(self, redis: aioredis.Redis) -> None:
        channel = keys_changed_channel(self.prefix)
        while True:
            pubsub = redis.pubsub()
            try:
                await pubsub.subscribe(channel)
                async for message in pubsub.listen():
                    if message["type"] == "subscribe":
                        self.live = True
                    elif message["type"] == "message":
                        self.end()
            except (RedisError, OSError) as exc:
                log.debug("keys-changed subscription lost (%s): every request asks Redis until it is back", exc)
            finally:
                self.live = False
                self.end()
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
            await asyncio.sleep(RETRY_S)

    async def aclose(self) -> None:
        self.live = False
        self.end()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
