"""One exception hierarchy for every Tandem process.

Lower libraries' errors (httpx, redis, zmq, vLLM's HTTP answers) are translated into the most specific
type below at the boundary where they happen (``raise ... from exc``). Only the router's edge turns
these into HTTP responses (``router.edge.openai_errors``); nothing else knows about status codes except
through the ``status_code`` attribute each class declares.

    TandemError
    ├── ConfigError                 bad settings, missing model folder, unusable install
    │   └── PortInUse               a port a node needs is held by another process (names it)
    ├── RequestError                the client's fault (4xx)
    │   ├── InvalidRequest          400  malformed JSON, context window exceeded, bad field values
    │   ├── AuthenticationFailed    401  missing, unknown or revoked API key
    │   ├── PermissionDenied        403  a valid key without the scope a route or header needs (admin)
    │   ├── ModelNotFound           404  model not served by any live node
    │   ├── NotFound                404  unknown resource (session, response id)
    │   ├── PayloadTooLarge         413  a body over the router's size limit (refused before reading it all)
    │   ├── ValidationFailed        422  well-formed JSON that violates the request schema
    │   └── RateLimited             429  over a request or token limit (carries retry_after)
    ├── Unavailable                 503  no node can take the request now (carries retry_after)
    ├── UpstreamError               502  a node failed or answered something we cannot use
    │   └── EngineRejected          the engine answered an error; keeps its status and message
    ├── StoreError                  Redis / database failures on a path that must not swallow them
    │   ├── StoreTimeout            the store did not answer within its configured timeout
    │   └── LakeUnwritable          the Parquet lake cannot be written (disk full, I/O error)
    ├── PeerUnauthenticated         node-to-node: a message without a valid MAC under the cluster secret,
    │                               or a one-host transport asked for by a peer not proven to be local
    └── VersionMismatch             a peer, a registry entry or transfer params of another version of a
                                    contract (wire.PROTOCOL, PARAMS_VERSION, registry schema) than ours
"""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error Tandem raises on purpose."""

    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class ConfigError(TandemError):
    """Settings or installation that cannot work; raised at start-up, never per request."""


class PortInUse(ConfigError):
    """A node's port is taken; the message names the port, what it is for and the process holding it."""

    def __init__(self, message: str, *, port: int, holder_pid: int | None = None) -> None:
        super().__init__(message)
        self.port = port
        self.holder_pid = holder_pid


class RequestError(TandemError):
    status_code = 400
    error_type = "invalid_request_error"


class InvalidRequest(RequestError):
    status_code = 400


class AuthenticationFailed(RequestError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(RequestError):
    status_code = 403
    error_type = "permission_error"
    code = "permission_denied"


class PayloadTooLarge(RequestError):
    status_code = 413
    code = "request_too_large"


class HeadersTooLarge(RequestError):
    status_code = 431
    code = "request_header_fields_too_large"


class BodyReadTimeout(RequestError):
    """The body did not arrive within the router's read deadline."""

    status_code = 408
    code = "request_timeout"


class ModelNotFound(RequestError):
    status_code = 404
    code = "model_not_found"


class NotFound(RequestError):
    status_code = 404
    code = "not_found"


class ValidationFailed(RequestError):
    status_code = 422


class RateLimited(RequestError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class ClientStalled(RequestError):
    """The client read nothing of its stream for the router's send timeout: the stream is cut so that
    the node slot and the engine request it holds go back (a client that never reads must not keep
    them). Never sent to the client, who is not reading; it is what the record says."""

    status_code = 408
    code = "client_stalled"


class Unavailable(TandemError):
    status_code = 503
    error_type = "service_unavailable"
    code = "no_capacity"

    def __init__(
        self, message: str, *, retry_after: float = 1.0, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message, code=code, param=param)
        self.retry_after = retry_after


class UpstreamError(TandemError):
    status_code = 502
    error_type = "upstream_error"


class EngineRejected(UpstreamError):
    """The engine answered with an error status; 4xx answers are the client's fault and keep their status."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.status_code = status
        if 400 <= status < 500:
            self.error_type = "invalid_request_error"


class StoreError(TandemError):
    """Redis or database failure where the caller must know (not on the telemetry slow path)."""


class StoreTimeout(StoreError):
    """The store (PostgreSQL, Redis) did not answer within its configured timeout: hung or overloaded."""


class PeerUnauthenticated(TandemError):
    """A node-to-node message that is not from the cluster: no valid MAC under the cluster secret, or a
    one-host transport (``shm``) asked for by a peer whose local credentials do not prove it."""


class LakeUnwritable(StoreError):
    """Writing the Parquet lake failed at the file system (``disk_full`` for ENOSPC / EDQUOT)."""

    def __init__(self, message: str, *, disk_full: bool) -> None:
        super().__init__(message)
        self.disk_full = disk_full


class VersionMismatch(TandemError):
    """Two processes speak different versions of one contract: the wire protocol (``kv_transfer.wire``),
    the transfer params (``contracts.transfer``) or the registry schema (``contracts.registry``). The
    message names the contract and both versions; the boundary that finds it refuses the message."""

    status_code = 502
    error_type = "upstream_error"

    def __init__(self, contract: str, *, theirs: object, ours: object) -> None:
        super().__init__(
            f"{contract} version {theirs!r} is not ours ({ours!r}): the two sides run different "
            "Tandem releases; upgrade them together"
        )
        self.contract = contract
        self.theirs = theirs
        self.ours = ours
