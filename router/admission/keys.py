"""Tenants and API keys.

A key looks like ``tdm-<key_id>-<secret>``: ``key_id`` (8 hex chars) is public and names the key in
``tandem keys list|revoke``; ``secret`` is 32 random bytes (urlsafe base64). Only
``sha256(full key)`` is stored. A plain (unsalted, fast) hash is enough because the key carries 256
bits of entropy: nobody can brute-force it, whereas slow hashes (bcrypt, argon2) exist to protect
low-entropy passwords and would cost milliseconds on every request.

Where keys live
    The persistent store (PostgreSQL, or SQLite by default) is the source of truth: tables
    ``tandem_tenants`` (limits, priority) and ``tandem_api_keys`` (hash, tenant, revoked). Redis holds
    the fast-path copy, one hash per key, ``<prefix>key:<sha256>`` with fields
    t=tenant, k=key_id, r=requests/min, m=tokens/min, p=priority, x=revoked (0/1), a=admin (0/1),
    h=HMAC; or n=1 for a *negative* entry (no such key), which expires after ``negative_ttl_s``. Losing
    Redis loses nothing: a miss reads the store and refills Redis.

Admin keys
    ``tandem keys create --admin``: a key listed in ``tandem_admin_keys`` (a table of its own, so a store
    created before admin keys existed needs no migration). Admin keys may read ``/metrics`` and
    ``/cluster`` and force the path with ``x-tandem-route``; their requests are otherwise like any other.

When auth is on
    ``<prefix>keys:exist`` is "1" once any key was ever created (revoked keys count, so revoking the last
    key does not open the cluster), "0" when none exists. It is written by ``create_key`` and, when
    absent (Redis lost or new), re-derived from the store. "0" expires after ``flag_off_ttl_s`` so a key
    created while Redis was unreachable turns auth on within that time. Mode ``auto`` (the local
    default): auth on iff a key exists. Mode ``required``: always on. There is deliberately no mode that
    keeps auth off while keys exist. Redis is checked, not trusted: ``key_records`` says how.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from contracts.errors import AuthenticationFailed, InvalidRequest, NotFound, StoreError
from contracts.secret import load_cluster_secret
from router.admission.auth_off import AuthOffLease, keys_changed_channel
from router.admission.key_records import (
    AUTH_LUA,
    KEY_SHAPE,
    AuthCode,
    _s,
    bearer_token,
    generate_key,
    hash_key,
    record_mac,
    record_mac_key,
)
from router.admission.outage import OutageGrace
from router.admission.priority_class import Priority
from router.sessions.sql import Database

log = logging.getLogger("tandem.router.keys")

ANONYMOUS_TENANT = "anonymous"
_TENANT_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS tandem_tenants (
        tenant_id TEXT PRIMARY KEY,
        rpm BIGINT NOT NULL,
        tpm BIGINT NOT NULL,
        priority TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS tandem_api_keys (
        key_id TEXT PRIMARY KEY,
        key_hash TEXT NOT NULL UNIQUE,
        tenant_id TEXT NOT NULL REFERENCES tandem_tenants(tenant_id),
        revoked INTEGER NOT NULL DEFAULT 0,
        created_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS tandem_admin_keys (
        key_id TEXT PRIMARY KEY REFERENCES tandem_api_keys(key_id))""",
)


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    """Who a request belongs to, and its limits (0 = unlimited)."""

    tenant_id: str
    rpm: int
    """Requests per minute."""
    tpm: int
    """Tokens per minute (prompt + completion)."""
    priority: Priority = Priority.INTERACTIVE
    key_id: str | None = None
    """The key that authenticated the request; None when auth is off."""
    admin: bool = False
    """An admin key (``tandem keys create --admin``): /metrics, /cluster, ``x-tandem-route``, ``x-tandem-node``."""

    @property
    def may_administer(self) -> bool:
        """Admin routes are open while auth is off (no key at all), else only to admin keys."""
        return self.key_id is None or self.admin


@dataclass(frozen=True, slots=True)
class ApiKeyInfo:
    """A key as ``tandem keys list`` shows it: never the key or its hash."""

    key_id: str
    tenant_id: str
    rpm: int
    tpm: int
    priority: Priority
    revoked: bool
    created_at: float
    admin: bool = False


class KeyStore:
    """Keys and tenants: management (CLI), the Redis fast-path copy, and ``authenticate``."""

    def __init__(
        self,
        redis: aioredis.Redis,
        db: Database,
        *,
        prefix: str = "tandem:",
        require_auth: bool = False,
        anonymous: Tenant | None = None,
        negative_ttl_s: float = 10.0,
        flag_off_ttl_s: float = 10.0,
        outage_grace_s: float = 60.0,
        auth_off_lease_s: float = 1.0,
        cluster_secret: bytes | None = None,
    ) -> None:
        self._redis = redis
        self._mac_key = record_mac_key(cluster_secret or load_cluster_secret(loopback_only=True))
        self.rejected: Counter[str] = Counter()
        """Redis content refused since start: ``record`` (a key record whose HMAC fails), ``flag`` (an
        auth flag of "0" while the store holds keys)."""
        self._keys_ever = False
        """A key has existed (store or verified record): auth is on for good in this process."""
        self._no_keys_at: float | None = None
        """When the store last said it holds no key (what makes a "0" flag believable)."""
        self._db = db
        self.prefix = prefix
        self.require_auth = require_auth
        self.anonymous = anonymous or Tenant(tenant_id=ANONYMOUS_TENANT, rpm=0, tpm=0)
        self.outage = OutageGrace(
            outage_grace_s,
            self.anonymous,
            auth_on=lambda: self.require_auth or self._keys_ever,
            store_has_keys=self._store_has_keys,
        )
        """Who is served while Redis cannot say (``router.admission.outage``)."""
        self.auth_off = AuthOffLease(prefix, auth_off_lease_s)
        """"Auth off" reused without a round trip, until a key is created (``router.admission.auth_off``)."""
        self._negative_ttl_ms = int(negative_ttl_s * 1000)
        self._flag_off_ttl_ms = int(flag_off_ttl_s * 1000)
        self._auth_script = redis.register_script(AUTH_LUA + "return tandem_auth()")

    # -- Redis names -------------------------------------------------------------------------------
    def record_key(self, key_hash: str) -> str:
        return f"{self.prefix}key:{key_hash}"

    @property
    def flag_key(self) -> str:
        return f"{self.prefix}keys:exist"

    async def init_schema(self) -> None:
        await self._db.create_schema(SCHEMA)

    # -- the fast path -----------------------------------------------------------------------------
    def auth_off_now(self) -> bool:
        """Auth is off by a lease still running: no Redis round trip is needed to say so."""
        return not (self.require_auth or self._keys_ever) and self.auth_off.valid()

    def auth_args(self, authorization: str | None) -> tuple[list[str], list[str]]:
        """KEYS and the first two ARGV of ``AUTH_LUA`` for this header."""
        token = bearer_token(authorization)
        if token is None:
            shape, key_hash = "0", "-"
        elif KEY_SHAPE.match(token):
            shape, key_hash = "1", hash_key(token)
        else:
            shape, key_hash = "2", "-"
        required = self.require_auth or self._keys_ever
        return [self.record_key(key_hash), self.flag_key], ["1" if required else "0", shape]

    async def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header value. Raises ``AuthenticationFailed`` for a
        missing, unknown or revoked key (when auth is on), ``StoreError`` when Redis and the store
        cannot answer. One Redis round trip when the key is cached."""
        keys, args = self.auth_args(authorization)
        epoch = self.auth_off.epoch
        for _ in range(3):
            try:
                reply = await self._auth_script(keys=keys, args=args)
                outcome = await self.interpret(reply, authorization, epoch)
            except (RedisError, StoreError) as exc:
                return await self.outage.vouch(authorization, exc)
            if outcome is not None:
                return outcome
        raise StoreError("authentication lookup did not settle after refilling the cache")

    async def interpret(self, reply: list, authorization: str | None, lease_epoch: int) -> Tenant | None:
        """Turn an ``AUTH_LUA`` reply into a tenant or an error; None means "cache refilled, run the
        script again". ``lease_epoch``: the auth-off lease's epoch when the script was sent."""
        code = int(reply[0])
        if code == AuthCode.OK:
            if not await self._verified(reply, authorization):
                return None
            tenant = Tenant(
                tenant_id=_s(reply[1]),
                key_id=_s(reply[2]),
                rpm=int(reply[3]),
                tpm=int(reply[4]),
                priority=Priority(_s(reply[5])),
                admin=_s(reply[6]) == "1",
            )
            self.outage.confirmed(authorization, tenant)
            return tenant
        if code == AuthCode.AUTH_OFF:
            if not await self._flag_off_confirmed():
                return None
            self.outage.auth_off()
            self.auth_off.grant(lease_epoch)
            return self.anonymous
        if code == AuthCode.MISSING:
            raise AuthenticationFailed("missing API key: send 'Authorization: Bearer tdm-...'", code="missing_api_key")
        if code == AuthCode.UNKNOWN_KEY:
            raise AuthenticationFailed("invalid API key")
        if code == AuthCode.REVOKED:
            raise AuthenticationFailed(f"API key {_s(reply[2])} has been revoked", code="revoked_api_key")
        if code == AuthCode.FLAG_UNKNOWN:
            await self.refresh_flag()
            return None
        if code == AuthCode.KEY_NOT_CACHED:
            token = bearer_token(authorization)
            if token is None:  # cannot happen: the script only asks for a given token
                raise AuthenticationFailed("missing API key")
            await self.refill(hash_key(token))
            return None
        raise StoreError(f"unexpected authentication reply {reply!r}")

    async def _verified(self, reply: list, authorization: str | None) -> bool:
        """Whether an OK reply's record carries a valid ``h``; if not, count it and replace the record
        from the store (the caller runs the script again)."""
        token = bearer_token(authorization)
        if token is None:  # cannot happen: the script only reads a record for a given token
            raise StoreError("a key record was read without a key")
        key_hash = hash_key(token)
        fields = [_s(v) for v in reply[1:6]] + ["0", _s(reply[6])]
        if hmac.compare_digest(_s(reply[7]), record_mac(self._mac_key, key_hash, fields)):
            self._keys_ever = True
            return True
        self.rejected["record"] += 1
        log.warning("key record %s in Redis fails its HMAC: ignored, replaced from the store", _s(reply[2])[:16])
        await self.refill(key_hash)
        return False

    async def _flag_off_confirmed(self) -> bool:
        """Whether "auth off" may stand: the store said "no key" within ``flag_off_ttl_s``. A "0"
        contradicted by the store is counted, overwritten, and auth stays on for good."""
        now = time.monotonic()
        if self._no_keys_at is not None and now - self._no_keys_at <= self._flag_off_ttl_ms / 1000:
            return True
        if not await self._store_has_keys():
            return True
        self.rejected["flag"] += 1
        log.warning("Redis says no API key exists but the store holds keys: auth stays on")
        try:
            await self._redis.set(self.flag_key, "1")
        except RedisError as exc:
            raise StoreError(f"cannot write the auth flag: {exc}") from exc
        return False

    async def _store_has_keys(self) -> bool:
        rows = await self._db.fetch("SELECT COUNT(*) FROM tandem_api_keys")
        exists = bool(rows and rows[0][0])
        self._keys_ever = self._keys_ever or exists
        if not exists:
            self._no_keys_at = time.monotonic()
        return exists

    # -- refilling Redis from the store ------------------------------------------------------------
    async def refresh_flag(self) -> bool:
        exists = await self._store_has_keys()
        try:
            if exists:
                await self._redis.set(self.flag_key, "1")
            else:
                await self._redis.set(self.flag_key, "0", px=self._flag_off_ttl_ms, nx=True)
        except RedisError as exc:
            raise StoreError(f"cannot write the auth flag: {exc}") from exc
        return exists

    async def refill(self, key_hash: str) -> bool:
        """Copy one key from the store into Redis (or a negative entry). True if the key exists."""
        rows = await self._db.fetch(
            """SELECT k.key_id, k.tenant_id, t.rpm, t.tpm, t.priority, k.revoked, a.key_id
               FROM tandem_api_keys k JOIN tandem_tenants t ON t.tenant_id = k.tenant_id
               LEFT JOIN tandem_admin_keys a ON a.key_id = k.key_id
               WHERE k.key_hash = $1""",
            key_hash,
        )
        rkey = self.record_key(key_hash)
        try:
            if rows:
                key_id, tenant_id, rpm, tpm, priority, revoked, admin = rows[0]
                await self._write_record(
                    rkey, key_id, tenant_id, rpm, tpm, priority, bool(revoked), admin=admin is not None
                )
            else:
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.delete(rkey)
                    pipe.hset(rkey, "n", "1")
                    pipe.pexpire(rkey, self._negative_ttl_ms)
                    await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"cannot cache API key: {exc}") from exc
        return bool(rows)

    async def _write_record(
        self,
        rkey: str,
        key_id: str,
        tenant_id: str,
        rpm: int,
        tpm: int,
        priority: str,
        revoked: bool,
        *,
        admin: bool = False,
    ) -> None:
        fields = [tenant_id, key_id, str(rpm), str(tpm), str(priority), str(int(revoked)), str(int(admin))]
        mac = record_mac(self._mac_key, rkey.removeprefix(self.record_key("")), fields)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(rkey)
            pipe.hset(rkey, mapping={**dict(zip("tkrmpxa", fields, strict=True)), "h": mac})
            await pipe.execute()

    # -- management (the CLI) ----------------------------------------------------------------------
    async def create_key(
        self,
        tenant_id: str,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        priority: Priority | None = None,
        default_rpm: int = 600,
        default_tpm: int = 1_000_000,
        admin: bool = False,
    ) -> tuple[ApiKeyInfo, str]:
        """Create a key for ``tenant_id`` (creating the tenant, or updating the limits given).
        Returns the key's info and the key itself, which is never stored and cannot be shown again."""
        if not _TENANT_ID.match(tenant_id) or tenant_id == ANONYMOUS_TENANT:
            raise InvalidRequest(f"tenant id must match {_TENANT_ID.pattern} and not be 'anonymous'")
        for name, value in (("rpm", rpm), ("tpm", tpm)):
            if value is not None and value < 0:
                raise InvalidRequest(f"{name} must be >= 0 (0 = unlimited)")
        now = time.time()
        existing = await self._db.fetch("SELECT rpm, tpm, priority FROM tandem_tenants WHERE tenant_id = $1", tenant_id)
        if existing:
            old_rpm, old_tpm, old_priority = existing[0]
            rpm = old_rpm if rpm is None else rpm
            tpm = old_tpm if tpm is None else tpm
            priority = Priority(old_priority) if priority is None else priority
            await self._db.execute(
                "UPDATE tandem_tenants SET rpm = $2, tpm = $3, priority = $4 WHERE tenant_id = $1",
                tenant_id,
                rpm,
                tpm,
                str(priority),
            )
        else:
            rpm = default_rpm if rpm is None else rpm
            tpm = default_tpm if tpm is None else tpm
            priority = Priority.INTERACTIVE if priority is None else priority
            await self._db.execute(
                """INSERT INTO tandem_tenants (tenant_id, rpm, tpm, priority, created_at)
                   VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant_id) DO NOTHING""",
                tenant_id,
                rpm,
                tpm,
                str(priority),
                now,
            )
        key_id, key = generate_key()
        await self._db.execute(
            """INSERT INTO tandem_api_keys (key_id, key_hash, tenant_id, revoked, created_at)
               VALUES ($1, $2, $3, 0, $4)""",
            key_id,
            hash_key(key),
            tenant_id,
            now,
        )
        if admin:
            await self._db.execute("INSERT INTO tandem_admin_keys (key_id) VALUES ($1)", key_id)
        AuthOffLease.key_created(self.prefix)
        try:
            await self._redis.set(self.flag_key, "1")
            await self._redis.publish(keys_changed_channel(self.prefix), key_id)
            await self._write_record(
                self.record_key(hash_key(key)), key_id, tenant_id, rpm, tpm, str(priority), False, admin=admin
            )
        except RedisError as exc:
            raise StoreError(
                f"key {key_id} is stored but Redis was not updated ({exc}); it works once Redis is back"
            ) from exc
        if existing:
            await self._recache_tenant(tenant_id)
        info = ApiKeyInfo(
            key_id=key_id,
            tenant_id=tenant_id,
            rpm=rpm,
            tpm=tpm,
            priority=priority,
            revoked=False,
            created_at=now,
            admin=admin,
        )
        return info, key

    async def list_keys(self, tenant_id: str | None = None) -> list[ApiKeyInfo]:
        sql = """SELECT k.key_id, k.tenant_id, t.rpm, t.tpm, t.priority, k.revoked, k.created_at, a.key_id
                 FROM tandem_api_keys k JOIN tandem_tenants t ON t.tenant_id = k.tenant_id
                 LEFT JOIN tandem_admin_keys a ON a.key_id = k.key_id"""
        args: tuple[str, ...] = ()
        if tenant_id is not None:
            sql += " WHERE k.tenant_id = $1"
            args = (tenant_id,)
        rows = await self._db.fetch(sql + " ORDER BY k.created_at, k.key_id", *args)
        return [
            ApiKeyInfo(
                key_id=r[0],
                tenant_id=r[1],
                rpm=int(r[2]),
                tpm=int(r[3]),
                priority=Priority(r[4]),
                revoked=bool(r[5]),
                created_at=float(r[6]),
                admin=r[7] is not None,
            )
            for r in rows
        ]

    async def revoke(self, key_id: str) -> ApiKeyInfo:
        """Mark a key revoked in the store, then in Redis. If Redis cannot be reached the key keeps
        working until it can: that raises ``StoreError`` so the operator reruns the command."""
        changed = await self._db.execute("UPDATE tandem_api_keys SET revoked = 1 WHERE key_id = $1", key_id)
        if not changed:
            raise NotFound(f"no API key with id {key_id!r}")
        await self._recache_key(key_id)
        return next(k for k in await self.list_keys() if k.key_id == key_id)

    async def _recache_key(self, key_id: str) -> None:
        rows = await self._db.fetch("SELECT key_hash FROM tandem_api_keys WHERE key_id = $1", key_id)
        for (key_hash,) in rows:
            try:
                await self.refill(key_hash)
            except StoreError as exc:
                raise StoreError(f"key {key_id} changed in the store but Redis was not updated: {exc}") from exc

    async def _recache_tenant(self, tenant_id: str) -> None:
        for (key_id,) in await self._db.fetch("SELECT key_id FROM tandem_api_keys WHERE tenant_id = $1", tenant_id):
            await self._recache_key(key_id)
