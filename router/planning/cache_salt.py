"""Per-tenant prefix caches: the ``cache_salt`` the router gives engines.

vLLM mixes a request's ``cache_salt`` into the hash of its first block, so requests with different
salts never share a prefix-cache block. Without one, any tenant could learn whether another tenant
sent a given prefix recently (a cached prefix answers measurably faster, and ``cached_tokens`` says
so outright). So once auth is on, every request is salted by its tenant:

    tenant part   HMAC-SHA256(salt key, tenant id)       none while auth is off, or for a tenant in
                                                         ``RouterSettings.shared_cache_tenants``
    client part   the request's own ``cache_salt``       optional: it can only narrow sharing
    salt          HMAC-SHA256(salt key, "t:" tenant part "\\0c:" client part), hex; none if both parts are

The salt key derives from the cluster secret (``contracts.secret``), so router replicas sharing the
secret salt alike (a replica with another secret still isolates tenants, but its tenants' prefixes are
cached apart from the other replicas'). Keyed, so neither a tenant id nor a client's salt reaches an
engine as given, and a client cannot compute another tenant's salt: what a client sends is always
hashed under its own tenant part, so it cannot choose the value an engine sees. With auth off (one
user) nothing is salted, as before: everyone shares the cache.

The router's fleet KV index is keyed by the same salted hashes (``router.kv_index.BlockHasher``), so
cache-aware routing and ``usage.tandem.fleet_cached_tokens`` count a tenant's own blocks only.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from contracts.errors import InvalidRequest
from contracts.secret import load_cluster_secret

SHARED_ALL = "*"
"""In ``shared_cache_tenants``: every tenant shares one cache (no tenant part), as with auth off."""
MAX_CLIENT_SALT_CHARS = 128
"""vLLM's own bound on ``cache_salt``."""


def salt_key(secret: bytes) -> bytes:
    """The key of every salt: a derivation of the cluster secret used for nothing else."""
    return hmac.new(secret, b"tandem cache_salt v1", hashlib.sha256).digest()


class CacheSalts:
    def __init__(self, key: bytes, shared_tenants: frozenset[str] = frozenset()) -> None:
        self._key = key
        self.shared_tenants = shared_tenants

    @classmethod
    def from_cluster_secret(cls, shared_tenants: frozenset[str] = frozenset()) -> CacheSalts:
        # The per-user default file is acceptable here (unlike on the KV wire): a salt only needs to be
        # the same across this cluster's router replicas, and unguessable to clients.
        return cls(salt_key(load_cluster_secret(loopback_only=True)), shared_tenants)

    def _mac(self, data: str) -> str:
        return hmac.new(self._key, data.encode(), hashlib.sha256).hexdigest()

    def tenant_part(self, tenant_id: str, *, authenticated: bool) -> str | None:
        """None while auth is off (``authenticated`` false) or for a tenant that shares the cache."""
        if not authenticated or SHARED_ALL in self.shared_tenants or tenant_id in self.shared_tenants:
            return None
        return self._mac("tenant\0" + tenant_id)

    def salt(self, tenant_id: str, *, authenticated: bool, client_salt: str | None = None) -> str | None:
        """The ``cache_salt`` an engine gets for this request (64 hex characters), or None."""
        tenant = self.tenant_part(tenant_id, authenticated=authenticated)
        if tenant is None and client_salt is None:
            return None
        return self._mac(f"t:{tenant or ''}\0c:{client_salt or ''}")


def take_client_salt(extra: dict[str, Any] | None) -> str | None:
    """Remove the client's ``cache_salt`` from a request's extra fields (it never reaches an engine as
    given) and return it; 400 unless it is a non-empty string of at most 128 characters, as vLLM."""
    if not extra or "cache_salt" not in extra:
        return None
    value = extra.pop("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_CLIENT_SALT_CHARS:
        raise InvalidRequest(
            f"cache_salt must be a non-empty string of at most {MAX_CLIENT_SALT_CHARS} characters",
            param="cache_salt",
            code="invalid_value",
        )
    return value
