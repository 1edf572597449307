"""What a key and its Redis record look like, and the Lua that reads a record (``KeyStore`` has the why).

Kept apart from ``keys`` (the store and its management): these are the pure parts that the admission
script in ``ratelimit`` shares: key shape and hash, the bearer header, the auth script fragment and its
reply codes, and the HMAC that authenticates a record written to Redis.

Redis is not trusted (anyone who reaches it can write it)
    ``h`` is an HMAC-SHA256 of the record's fields and the key hash it is stored under, keyed by a
    derivation of the cluster secret (``contracts.secret``), which Redis never sees. A record whose ``h``
    does not verify (forged, edited, copied to another key's name) is ignored: it is counted in
    ``rejected["record"]`` and replaced from the store, so the request is answered as the store says. The
    check runs after the admission script, so a forged record can at worst charge a rate-limit bucket
    once; it never admits anyone. A forged *negative* or *revoked* entry can only refuse a key (Redis
    can refuse service anyway by being down).

The auth flag (``keys:exist``)
    The flag is only a hint, and fails closed: "0" is believed only while the store itself said "no key"
    within ``flag_off_ttl_s`` (one store query per that period while auth is off). Once this process has
    seen a key exist (in the store or by a verified record) it sends the script "required" for good, so
    ``keys:exist = 0`` written by someone else changes nothing; a "0" contradicted by the store is counted
    in ``rejected["flag"]`` and overwritten with "1".
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

KEY_PREFIX = "tdm-"
KEY_SHAPE = re.compile(r"^tdm-([0-9a-f]{8})-[A-Za-z0-9_-]{43}$")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> tuple[str, str]:
    """(key_id, full key)."""
    key_id = secrets.token_hex(4)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
    return key_id, f"{KEY_PREFIX}{key_id}-{secret}"


def bearer_token(authorization: str | None) -> str | None:
    """The token of ``Authorization: Bearer <token>``; None when absent or not a bearer header."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


# Authentication as a Lua fragment, shared by the auth-only script below and the admission script in
# ``ratelimit`` (auth and limits in one round trip). KEYS[1] = key record, KEYS[2] = exist flag;
# ARGV[1] = "1" when mode is required; ARGV[2] = "1" for a well-formed bearer token, "2" for a malformed
# one (rejected without a store lookup), "0" for none.
# Returns {code, ...}: see ``AuthCode``.
AUTH_LUA = """
local function tandem_auth()
  local flag = redis.call('GET', KEYS[2])
  if not flag then return {4} end
  if ARGV[1] ~= '1' and flag ~= '1' then return {1} end
  if ARGV[2] == '0' then return {6} end
  if ARGV[2] == '2' then return {7} end
  local rec = redis.call('HMGET', KEYS[1], 't', 'k', 'r', 'm', 'p', 'x', 'n', 'a', 'h')
  if rec[7] then return {7} end
  if not rec[1] then return {2} end
  if rec[6] == '1' then return {3, rec[1], rec[2]} end
  return {0, rec[1], rec[2], rec[3] or '', rec[4] or '', rec[5] or '', rec[8] or '0', rec[9] or ''}
end
"""


class AuthCode:
    OK = 0
    AUTH_OFF = 1
    KEY_NOT_CACHED = 2
    REVOKED = 3
    FLAG_UNKNOWN = 4
    RATE_LIMITED = 5
    MISSING = 6
    UNKNOWN_KEY = 7


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def record_mac_key(secret: bytes) -> bytes:
    """The key of the key records' HMAC: a derivation of the cluster secret for this one use."""
    return hmac.new(secret, b"tandem key record v1", hashlib.sha256).digest()


def record_mac(mac_key: bytes, key_hash: str, fields: list[str]) -> str:
    """``h`` of a key record: binds t, k, r, m, p, x, a (in that order) to the key hash it is stored under."""
    msg = "\x1f".join([key_hash, *fields]).encode()
    return hmac.new(mac_key, msg, hashlib.sha256).hexdigest()
