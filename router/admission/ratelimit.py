"""Rate limits: token buckets in Redis, checked and charged atomically by one Lua script.

Algorithm (token bucket, one per limit)
    A limit of L per minute is a bucket of capacity L that refills continuously at L/60 per second;
    a request may pass when every bucket it touches holds at least what it needs. Buckets are hashes
    ``<prefix>rl:<layer>:<unit>`` with fields l (level, may be fractional or negative) and t (time of
    the last update, ms, Redis server clock so all routers agree). A full bucket is deleted; an idle one
    expires once it would have refilled (PEXPIRE = time to full + 1 s). A missing bucket is full.

Limits (0 = unlimited, the bucket is not touched)
    tenant layer: ``Tenant.rpm`` requests/min and ``Tenant.tpm`` tokens/min, per tenant
    global layer:  ``global_rpm`` and ``global_tpm`` over all tenants (``AdmissionSettings``)
    Auth off: every request is the ``anonymous`` tenant with ``anonymous_rpm`` / ``anonymous_tpm``.

What is charged, and when
    admission:  1 request, and tokens = prompt_tokens + reserve, where reserve = ``max_tokens`` when the
                client sets it, else ``completion_reserve_tokens`` (default 256). Reserving the
                completion up front keeps tokens/min honest while many long generations run at once;
                charging only the prompt would let a tenant start unbounded work within its limit.
    settle:     at the end, the token buckets get back ``reserve - actual_completion_tokens`` (refund
                when the answer was shorter; an extra charge, possibly into debt, when it was longer).
    A check is all-or-nothing: if any bucket lacks what it needs, nothing is charged.
    A cost larger than a bucket's capacity needs only a full bucket, then drives it negative (debt),
    so a huge request is possible but the tenant then waits it off.

``retry_after``
    For each short bucket: (need - level) / refill rate; the answer is the largest over the short
    buckets, in seconds (rounded up to whole ms). It is exact for an otherwise idle tenant: retrying
    after it succeeds unless someone else spent the refill first.

Scripts build bucket key names from the tenant id at run time, so they assume one Redis (or one hash
slot), not Redis Cluster.

While Redis is unreachable (a restart)
    Admission does not fail the request: ``router.admission.outage`` serves a key Redis confirmed within
    ``store_outage_grace_s`` (and everyone, if auth was off that recently), and nothing is charged or
    settled for those requests (``Admission.uncharged``); any other key gets 503 + Retry-After. Limits
    are lenient for the length of the outage; serving stops only for keys nobody can vouch for.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from contracts.errors import InvalidRequest, RateLimited, StoreError, Unavailable
from router.admission.key_records import AUTH_LUA, AuthCode
from router.admission.keys import KeyStore, Tenant
from router.admission.priority_class import Priority, resolve_priority

log = logging.getLogger("tandem.router.admission")

BUCKETS_LUA = """
local function bucket_level(key, cap, now)
  local v = redis.call('HMGET', key, 'l', 't')
  if not v[1] then return cap end
  local level = tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60000
  if level > cap then level = cap end
  return level
end

local function bucket_store(key, cap, level, now)
  if level >= cap then redis.call('DEL', key) return end
  redis.call('HSET', key, 'l', tostring(level), 't', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((cap - level) * 60000 / cap) + 1000)
end

local function clock(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- charge rcost requests and tcost tokens to the tenant and global buckets, all or nothing.
-- Returns nil when charged, {5, retry_ms, which} when some bucket is short.
local function charge(prefix, tenant, rpm, tpm, rcost, tcost, grpm, gtpm, now)
  local b = {}
  if rcost > 0 and rpm > 0 then
    b[#b + 1] = {prefix .. 'rl:t:' .. tenant .. ':req', rpm, rcost, 'tenant requests-per-minute'}
  end
  if rcost > 0 and grpm > 0 then
    b[#b + 1] = {prefix .. 'rl:g:req', grpm, rcost, 'global requests-per-minute'}
  end
  if tcost > 0 and tpm > 0 then
    b[#b + 1] = {prefix .. 'rl:t:' .. tenant .. ':tok', tpm, tcost, 'tenant tokens-per-minute'}
  end
  if tcost > 0 and gtpm > 0 then
    b[#b + 1] = {prefix .. 'rl:g:tok', gtpm, tcost, 'global tokens-per-minute'}
  end
  local retry, which = 0, ''
  for _, x in ipairs(b) do
    x[5] = bucket_level(x[1], x[2], now)
    local need = math.min(x[3], x[2])
    if x[5] < need then
      local wait = math.ceil((need - x[5]) * 60000 / x[2])
      if wait > retry then
        retry = wait
        which = x[4] .. ' limit ' .. x[2]
      end
    end
  end
  if retry > 0 then return {5, retry, which} end
  for _, x in ipairs(b) do bucket_store(x[1], x[2], x[5] - x[3], now) end
  return nil
end
"""

# KEYS: record, flag. ARGV: 1 required, 2 token shape, 3 prefix, 4 now ('' = Redis TIME),
# 5 request cost, 6 token cost, 7 global rpm, 8 global tpm, 9 anonymous rpm, 10 anonymous tpm.
ADMIT_LUA = (
    AUTH_LUA
    + BUCKETS_LUA
    + """
local a = tandem_auth()
if a[1] ~= 0 and a[1] ~= 1 then return a end
local now = clock(ARGV[4])
local tenant, rpm, tpm
if a[1] == 0 then
  tenant, rpm, tpm = a[2], tonumber(a[4]), tonumber(a[5])
else
  tenant, rpm, tpm = 'anonymous', tonumber(ARGV[9]), tonumber(ARGV[10])
end
local r = charge(ARGV[3], tenant, rpm, tpm, tonumber(ARGV[5]), tonumber(ARGV[6]),
                 tonumber(ARGV[7]), tonumber(ARGV[8]), now)
if r then return r end
a[#a + 1] = now
return a
"""
)

# ARGV: 1 prefix, 2 now, 3 tenant, 4 rpm, 5 tpm, 6 request cost, 7 token cost, 8 global rpm, 9 global tpm
CHARGE_LUA = (
    BUCKETS_LUA
    + """
local r = charge(ARGV[1], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]),
                 tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), clock(ARGV[2]))
if r then return r end
return {0}
"""
)

# ARGV: 1 prefix, 2 now, 3 tenant, 4 tpm, 5 global tpm, 6 delta tokens (+ refund, - extra charge)
SETTLE_LUA = (
    BUCKETS_LUA
    + """
local now = clock(ARGV[2])
local delta = tonumber(ARGV[6])
local caps = {{ARGV[1] .. 'rl:t:' .. ARGV[3] .. ':tok', tonumber(ARGV[4])},
              {ARGV[1] .. 'rl:g:tok', tonumber(ARGV[5])}}
for _, x in ipairs(caps) do
  if x[2] > 0 then
    local level = bucket_level(x[1], x[2], now) + delta
    if level > x[2] then level = x[2] end
    bucket_store(x[1], x[2], level, now)
  end
end
return 0
"""
)


@dataclass(frozen=True, slots=True)
class GlobalLimits:
    rpm: int = 0
    """Requests per minute over all tenants; 0 = unlimited."""
    tpm: int = 0
    """Tokens per minute over all tenants; 0 = unlimited."""


@dataclass(slots=True)
class Admission:
    """An admitted request: who it is, its class, and what it reserved (for ``settle``)."""

    tenant: Tenant
    priority: Priority
    prompt_tokens: int = 0
    reserved_completion_tokens: int = 0
    tokens_charged: bool = False
    settled: bool = field(default=False)
    uncharged: bool = False
    """Admitted while the store was unreachable (``router.admission.outage``): no limit is charged or settled."""


ClockMs = Callable[[], int]


class Gatekeeper:
    """Authentication plus rate limits, the router's admission fast path.

    ``admit`` authenticates and charges the request (and its tokens, when known) in one Redis round
    trip; ``charge_tokens`` charges tokens later when the router learns them only after tokenizing;
    ``settle`` corrects the token buckets when the request ends. ``clock_ms`` replaces Redis' clock in
    tests (all routers must share one clock, so production leaves it None).
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: KeyStore,
        *,
        global_limits: GlobalLimits = GlobalLimits(),  # noqa: B008  (frozen, immutable)
        completion_reserve_tokens: int = 256,
        clock_ms: ClockMs | None = None,
    ) -> None:
        self._redis = redis
        self.keys = keys
        self.global_limits = global_limits
        self.completion_reserve_tokens = completion_reserve_tokens
        self._clock_ms = clock_ms
        self._admit = redis.register_script(ADMIT_LUA)
        self._charge = redis.register_script(CHARGE_LUA)
        self._settle = redis.register_script(SETTLE_LUA)

    def _now(self) -> str:
        return "" if self._clock_ms is None else str(self._clock_ms())

    def _reserve(self, max_tokens: int | None) -> int:
        if max_tokens is None:
            return self.completion_reserve_tokens
        if max_tokens < 0:
            raise InvalidRequest("max_tokens must be >= 0", param="max_tokens")
        return max_tokens

    async def authenticate(self, authorization: str | None) -> Tenant:
        """Auth only (no limit charged): for routes that start no generation."""
        return await self.keys.authenticate(authorization)

    async def admit(
        self,
        authorization: str | None,
        *,
        priority_header: str | None = None,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
    ) -> Admission:
        """Authenticate, then charge one request and, when ``prompt_tokens`` is given, its tokens.
        Raises ``AuthenticationFailed``, ``RateLimited`` (with ``retry_after`` seconds), ``InvalidRequest``
        (bad priority header), ``StoreError``."""
        reserve = self._reserve(max_tokens) if prompt_tokens is not None else 0
        token_cost = (prompt_tokens + reserve) if prompt_tokens is not None else 0
        g = self.global_limits
        anon = self.keys.anonymous
        if not (g.rpm or g.tpm or anon.rpm or anon.tpm) and self.keys.auth_off_now():
            # Nothing to check and no bucket to charge: the answer Redis would give (router.admission.auth_off).
            return Admission(
                tenant=anon,
                priority=resolve_priority(anon.priority, priority_header),
                prompt_tokens=prompt_tokens or 0,
                reserved_completion_tokens=reserve,
            )
        keys, auth_args = self.keys.auth_args(authorization)
        args = [
            *auth_args,
            self.keys.prefix,
            self._now(),
            "1",
            str(token_cost),
            str(g.rpm),
            str(g.tpm),
            str(anon.rpm),
            str(anon.tpm),
        ]
        epoch = self.keys.auth_off.epoch
        for _ in range(3):
            try:
                reply = await self._admit(keys=keys, args=args)
                if int(reply[0]) == AuthCode.RATE_LIMITED:
                    raise _limited(reply)
                tenant = await self.keys.interpret(reply, authorization, epoch)
            except (RedisError, StoreError) as exc:
                # The store is down (a Redis restart): serve whom it confirmed lately, uncharged; or 503.
                tenant = await self.keys.outage.vouch(authorization, exc)
                return Admission(
                    tenant=tenant,
                    priority=resolve_priority(tenant.priority, priority_header),
                    settled=True,
                    uncharged=True,
                )
            if tenant is not None:
                return Admission(
                    tenant=tenant,
                    priority=resolve_priority(tenant.priority, priority_header),
                    prompt_tokens=prompt_tokens or 0,
                    reserved_completion_tokens=reserve,
                    tokens_charged=prompt_tokens is not None,
                )
        raise StoreError("admission did not settle after refilling the key cache")

    def charges_tokens(self, admission: Admission) -> bool:
        """Whether a token bucket (the tenant's or the global one) applies to this request: only then
        must its prompt be counted before it is served (0 = unlimited)."""
        return not admission.uncharged and (admission.tenant.tpm > 0 or self.global_limits.tpm > 0)

    async def charge_tokens(self, admission: Admission, prompt_tokens: int, max_tokens: int | None) -> None:
        """Charge the tokens of an already admitted request (when ``admit`` ran before tokenizing)."""
        if admission.tokens_charged:
            raise InvalidRequest("tokens already charged for this request")
        reserve = self._reserve(max_tokens)
        t = admission.tenant
        g = self.global_limits
        if t.tpm <= 0 and g.tpm <= 0:
            # No token bucket to charge (0 = unlimited): no round trip; settle has nothing to correct.
            admission.prompt_tokens = prompt_tokens
            admission.reserved_completion_tokens = reserve
            admission.tokens_charged = admission.settled = True
            return
        args = [
            self.keys.prefix,
            self._now(),
            t.tenant_id,
            t.rpm,
            t.tpm,
            0,
            prompt_tokens + reserve,
            g.rpm,
            g.tpm,
        ]
        try:
            reply = await self._charge(args=[str(a) for a in args])
        except RedisError as exc:
            if self.keys.outage.grace_s <= 0:
                raise Unavailable(f"the rate-limit store is unreachable: {exc}", retry_after=5) from exc
            # Admitted a moment ago, so its key was good: serve it uncharged (store_outage_grace_s).
            log.warning("token charge skipped, store unreachable: %s", exc)
            admission.uncharged = admission.tokens_charged = admission.settled = True
            self.keys.outage.admissions += 1
            return
        if int(reply[0]) == AuthCode.RATE_LIMITED:
            raise _limited(reply)
        admission.prompt_tokens = prompt_tokens
        admission.reserved_completion_tokens = reserve
        admission.tokens_charged = True

    async def settle(self, admission: Admission, completion_tokens: int) -> None:
        """Correct the token buckets with the completion's real length. Call once when the request
        ends (also on error or client disconnect, with the tokens generated so far). Idempotent."""
        if admission.settled or not admission.tokens_charged:
            admission.settled = True
            return
        admission.settled = True
        delta = admission.reserved_completion_tokens - completion_tokens
        if delta == 0:
            return
        t = admission.tenant
        args = [self.keys.prefix, self._now(), t.tenant_id, t.tpm, self.global_limits.tpm, delta]
        try:
            await self._settle(args=[str(a) for a in args])
        except RedisError as exc:
            raise StoreError(f"token settle failed: {exc}") from exc


def _limited(reply: list) -> RateLimited:
    retry_s = int(reply[1]) / 1000.0
    which = reply[2].decode() if isinstance(reply[2], bytes) else reply[2]
    return RateLimited(f"rate limit exceeded: {which}; retry after {math.ceil(retry_s)} s", retry_after=retry_s)
