"""Object-store failures -> distckpt's typed errors, and the bounded retry of throttled requests.

The one place where exceptions of the S3 client stack (botocore, aiobotocore, aiohttp, s3fs, fsspec)
become classes of distckpt.errors, as :func:`distckpt.errors.from_os_error` is for errno:

=====================================================  ==========================================
what the store / client said                            class
=====================================================  ==========================================
NoSuchBucket                                            BucketNotFoundError
NoSuchKey, 404 (or s3fs's bare FileNotFoundError)       ObjectNotFoundError
AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch, ObjectStoreAccessError
ExpiredToken, 403, no / partial credentials
connection refused / reset, DNS, connect/read timeout   EndpointUnreachableError
a body cut short or not matching its checksum           ResponseIncompleteError (an EndpointUnreachableError)
SlowDown, Throttling, 429, 503 ... (after the retries)  ThrottledError
QuotaExceeded, XMinioStorageFull, 507 ...               QuotaExceededError
PreconditionFailed / 412 on a conditional create        CheckpointExistsError (another writer won)
anything else                                           ObjectStoreError
=====================================================  ==========================================

s3fs turns a botocore ``ClientError`` into a builtin ``OSError`` whose ``__cause__`` is the
ClientError; the error code and HTTP status are read from whichever exception in the
``__cause__`` / ``__context__`` chain carries a response, so both forms translate the same.

Retries: the client stack already retries connection errors (s3fs: 5 tries) and, in botocore's
``standard`` mode, throttling. :func:`call_with_retry` / :func:`acall_with_retry` add distckpt's
own bound on top for throttling only: exponential backoff with full jitter, at most
``RetryPolicy.attempts`` tries and ``RetryPolicy.total_s`` seconds, then :class:`ThrottledError`.
Nothing else is retried here: a refused credential or a missing bucket does not get better. (A read
whose answer is shorter than the object's known size is asked again by its caller, at most
``SHORT_ANSWER_TRIES`` times: :mod:`distckpt.storage.object.store`.)
"""

from __future__ import annotations

import asyncio
import errno as _errno
import random
import socket
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator, TypeVar

from ...errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    DistCkptError,
    EndpointUnreachableError,
    ResponseIncompleteError,
    ObjectNotFoundError,
    ObjectStoreAccessError,
    ObjectStoreError,
    QuotaExceededError,
    ThrottledError,
)

__all__ = ["RetryPolicy", "translate", "is_throttle", "call_with_retry", "acall_with_retry",
           "client_config", "error_code"]

T = TypeVar("T")

THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "RequestLimitExceeded", "TooManyRequests", "TooManyRequestsException",
    "TooManyRequest", "ErrTooManyRequest", "ProvisionedThroughputExceededException", "BandwidthLimitExceeded",
    "ServiceUnavailable", "ServiceUnavailableException", "RequestTimeTooSkewedRetry",
    # AWS: two conditional writes of one key in flight at once; the loser is told to retry (the
    # retry then gets 412, which is the real answer).
    "ConditionalRequestConflict",
})
THROTTLE_STATUS = frozenset({429, 503})
ACCESS_CODES = frozenset({
    "AccessDenied", "AccountProblem", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "InvalidToken", "TokenRefreshRequired", "RequestTimeTooSkewed", "InvalidSecurity",
    "NotSignedUp", "Forbidden", "NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
    "UnauthorizedAccess", "InvalidClientTokenId",
})
QUOTA_CODES = frozenset({
    "QuotaExceeded", "XMinioAdminBucketQuotaExceeded", "XMinioStorageFull", "InsufficientStorage",
    "StorageFull", "EntityTooLargeForQuota", "storageQuotaExceeded",
})
QUOTA_STATUS = frozenset({507})
PRECONDITION_CODES = frozenset({"PreconditionFailed", "412"})


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff for throttled requests.

    Try ``attempts`` times at most; before try n+1 sleep a random time in
    [0, min(max_s, base_s * 2**n)] ("full jitter": ranks that were throttled together do not
    retry together); no retry begins later than ``total_s`` seconds after the first try (so the
    whole call lasts at most ``total_s`` plus one request).
    """

    attempts: int = 6
    base_s: float = 0.2
    max_s: float = 5.0
    total_s: float = 60.0

    def delays(self) -> Iterator[float]:
        for n in range(self.attempts - 1):
            yield random.uniform(0, min(self.max_s, self.base_s * (2 ** n)))


DEFAULT_RETRY = RetryPolicy()


def client_config(*, connect_timeout_s: float = 10, read_timeout_s: float = 60, max_attempts: int = 3) -> dict:
    """botocore ``Config`` keywords (s3fs ``config_kwargs``) that bound how long one request can
    take against a dead or stuck endpoint: a connect and a read timeout, and botocore's
    ``standard`` retry mode with ``max_attempts`` tries (throttles and 5xx, with its backoff)."""
    return {"connect_timeout": connect_timeout_s, "read_timeout": read_timeout_s,
            "retries": {"max_attempts": max_attempts, "mode": "standard"}}


# ---------------------------------------------------------------------------------------------- reading an error


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend([e.__cause__, e.__context__])


def _response(exc: BaseException) -> dict | None:
    for e in _chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and ("Error" in resp or "ResponseMetadata" in resp):
            return resp
    return None


def error_code(exc: BaseException) -> tuple[str | None, int | None, str | None]:
    """(error code, HTTP status, server message) of the response in ``exc``'s chain, or Nones."""
    resp = _response(exc)
    if resp is None:
        return None, None, None
    err = resp.get("Error") or {}
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    code = err.get("Code") or (str(status) if status else None)
    return code, status, err.get("Message")


def _connection_failure(exc: BaseException) -> BaseException | None:
    """The exception in the chain that says the endpoint did not answer, if any."""
    try:
        import botocore.exceptions as bce
        boto_conn: tuple = (bce.EndpointConnectionError, bce.ConnectionClosedError, bce.ConnectTimeoutError,
                            bce.ReadTimeoutError, bce.ProxyConnectionError, bce.HTTPClientError)
    except ImportError:  # pragma: no cover - s3fs needs botocore
        boto_conn = ()
    try:
        import aiohttp
        # ClientPayloadError: the answer's body was cut off (a reset connection mid-response)
        aio_conn: tuple = (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError, aiohttp.ClientPayloadError)
    except ImportError:  # pragma: no cover
        aio_conn = ()
    try:
        from fsspec.exceptions import FSTimeoutError
        fs_conn: tuple = (FSTimeoutError,)
    except ImportError:  # pragma: no cover
        fs_conn = ()
    kinds = boto_conn + aio_conn + fs_conn + (ConnectionError, socket.gaierror, socket.timeout, TimeoutError,
                                              asyncio.TimeoutError)
    for e in _chain(exc):
        if isinstance(e, kinds) and not isinstance(e, DistCkptError):
            return e
    return None


def _incomplete_body(exc: BaseException) -> BaseException | None:
    """The exception in the chain that says an answer's body arrived short or corrupted (the
    endpoint answered, the network cut or garbled it), if any."""
    kinds: tuple = ()
    try:
        import botocore.exceptions as bce
        kinds += (bce.FlexibleChecksumError, bce.IncompleteReadError, bce.ResponseStreamingError)
    except (ImportError, AttributeError):  # pragma: no cover - older botocore lacks some
        pass
    try:
        import aiohttp
        kinds += (aiohttp.ClientPayloadError,)
    except ImportError:  # pragma: no cover
        pass
    for e in _chain(exc):
        if kinds and isinstance(e, kinds) and not isinstance(e, DistCkptError):
            return e
    return None


def _errno_in_chain(exc: BaseException) -> int | None:
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (_errno.ECONNREFUSED, _errno.ECONNRESET, _errno.EHOSTUNREACH,
                                                   _errno.ENETUNREACH, _errno.ETIMEDOUT, _errno.ECONNABORTED):
            return e.errno
    return None


def is_throttle(exc: BaseException) -> bool:
    """True when ``exc`` (or its chain) is the store asking the client to slow down."""
    code, status, message = error_code(exc)
    if code in THROTTLE_CODES or status in THROTTLE_STATUS:
        return True
    # s3fs without a response object: its own SlowDown translation (errno EBUSY, the message kept)
    text = str(exc)
    return isinstance(exc, OSError) and exc.errno == _errno.EBUSY and (
        "SlowDown" in text or "reduce your request rate" in text or "Too Many Requests" in text)


def _credentials_missing(exc: BaseException) -> str | None:
    try:
        import botocore.exceptions as bce
    except ImportError:  # pragma: no cover
        return None
    for e in _chain(exc):
        if isinstance(e, (bce.NoCredentialsError, bce.PartialCredentialsError, bce.CredentialRetrievalError)):
            return type(e).__name__
    return None


def translate(
    exc: BaseException,
    *,
    url: str,
    operation: str,
    rank: int | None = None,
    endpoint: str | None = None,
    conditional: bool = False,
    attempts: int | None = None,
    waited_s: float | None = None,
) -> DistCkptError:
    """The typed error for ``exc``, raised by an object-store request about ``url``.

    Args:
        exc: what the client stack raised (botocore / aiobotocore / aiohttp / s3fs / builtin).
        url: the object or prefix concerned, as the user wrote it (``s3://bucket/key``).
        operation: what distckpt was doing, for the message (``upload part``, ``write MANIFEST``).
        rank: the rank (else RANK from the environment, as every DistCkptError).
        endpoint: the endpoint URL, named in the message when the endpoint is at fault.
        conditional: the request was a conditional create (If-None-Match: *); a precondition
            failure then means another writer created the object first: CheckpointExistsError.
        attempts, waited_s: for a throttle that survived :func:`call_with_retry`.

    Returns the error (the caller raises it ``from exc``); a DistCkptError is returned unchanged.
    Never raises.
    """
    if isinstance(exc, DistCkptError):
        return exc
    code, status, server_message = error_code(exc)
    where = f" (endpoint {endpoint})" if endpoint else ""
    said = (f"{code}" if code else "") + (f" (HTTP {status})" if status and str(status) != code else "")
    said += f": {server_message}" if server_message else ""
    common: dict[str, Any] = {"path": url, "rank": rank, "url": url, "operation": operation,
                              "code": code, "status": status, "endpoint": endpoint}

    if conditional and (code in PRECONDITION_CODES or status == 412 or isinstance(exc, FileExistsError)):
        return CheckpointExistsError(
            f"{operation}: the conditional create of {url} failed because the object already exists: "
            f"another writer committed it first{where}", errno=_errno.EEXIST, **common,
            remedy="Another save committed this checkpoint first; save to a new step (or pass overwrite=True "
                   "when replacing it is intended).")
    if code == "NoSuchBucket":
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return BucketNotFoundError(f"{operation} {url} failed: the bucket {bucket!r} does not exist{where}",
                                   errno=_errno.ENOENT, bucket=bucket, **common)
    if code in QUOTA_CODES or status in QUOTA_STATUS:
        return QuotaExceededError(f"{operation} {url} failed: the store is out of quota or space: {said}{where}",
                                  errno=_errno.EDQUOT, **common)
    if is_throttle(exc):
        tries = f" after {attempts} tries over {waited_s:.1f} s" if attempts else ""
        return ThrottledError(f"{operation} {url} failed: the store is throttling requests ({said}){tries}{where}",
                              errno=_errno.EBUSY, attempts=attempts, waited_s=waited_s, **common)
    missing_creds = _credentials_missing(exc)
    if missing_creds:
        common["code"] = missing_creds
        return ObjectStoreAccessError(
            f"{operation} {url} failed: no credentials for the object store were found ({missing_creds})",
            errno=_errno.EACCES, **common,
            remedy="Provide credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or "
                   "storage_options={'key': ..., 'secret': ...}.")
    if code in ACCESS_CODES or status == 403 or (code is None and isinstance(exc, PermissionError)):
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch"):
            detail = "the access key or the secret is wrong"
        elif code in ("ExpiredToken", "InvalidToken", "TokenRefreshRequired"):
            detail = "the session token expired or is invalid"
        elif code == "RequestTimeTooSkewed":
            detail = "this node's clock is too far from the server's"
        elif code == "403":  # a HEAD request: no body, so no reason
            detail = "the credentials are wrong or do not grant this"
        else:
            detail = "the credentials do not grant this"
        return ObjectStoreAccessError(f"{operation} {url} refused: {detail} ({said or exc}){where}",
                                      errno=_errno.EACCES, **common)
    if code in ("NoSuchKey", "404", "NoSuchUpload") or (code is None and isinstance(exc, FileNotFoundError)):
        return ObjectNotFoundError(f"{operation} {url} failed: no such object ({said or exc})",
                                   errno=_errno.ENOENT, **common)
    if code is None:
        cut = _incomplete_body(exc)
        if cut is not None:
            common["code"] = type(cut).__name__
            return ResponseIncompleteError(
                f"{operation} {url} failed: the object store endpoint{' ' + endpoint if endpoint else ''} answered, but "
                f"the body arrived cut short or corrupted in transit: {type(cut).__name__}: {cut}",
                errno=_errno.EIO, **common)
        conn = _connection_failure(exc)
        if conn is not None:
            common["code"] = type(conn).__name__
            err = _errno_in_chain(exc) or (_errno.ETIMEDOUT if "imeout" in type(conn).__name__ else _errno.EHOSTUNREACH)
            return EndpointUnreachableError(
                f"{operation} {url} failed: the object store endpoint{' ' + endpoint if endpoint else ''} did not answer: "
                f"{type(conn).__name__}: {conn}", errno=err, **common)
    return ObjectStoreError(f"{operation} {url} failed: {said or f'{type(exc).__name__}: {exc}'}{where}",
                            errno=getattr(exc, "errno", None) or _errno.EIO, **common)


# ---------------------------------------------------------------------------------------------- retrying throttles


def _retry_delay(exc: Exception, delays, start: float, attempt: int, policy: RetryPolicy, *, url: str,
                 operation: str, rank: int | None, endpoint: str | None, conditional: bool) -> float:
    """How long to wait before trying again after ``exc``, or raise it as its typed error: a
    DistCkptError as it is; a throttle while ``policy`` has a delay left within its total time;
    anything else (or a spent policy) through :func:`translate`."""
    if isinstance(exc, DistCkptError):
        raise exc
    delay = next(delays, None) if is_throttle(exc) else None
    if delay is None or time.monotonic() - start + delay > policy.total_s:
        raise translate(exc, url=url, operation=operation, rank=rank, endpoint=endpoint,
                        conditional=conditional, attempts=attempt, waited_s=time.monotonic() - start) from exc
    return delay


def call_with_retry(fn: Callable[[], T], *, url: str, operation: str, rank: int | None = None,
                    endpoint: str | None = None, conditional: bool = False,
                    policy: RetryPolicy = DEFAULT_RETRY, sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, retried while the store throttles (bounded by ``policy``); any failure is raised
    as the typed error of :func:`translate` (``ThrottledError`` once the retries are spent)."""
    start, delays, attempt = time.monotonic(), policy.delays(), 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every failure leaves as a typed error
            sleep(_retry_delay(exc, delays, start, attempt, policy, url=url, operation=operation, rank=rank,
                               endpoint=endpoint, conditional=conditional))


async def acall_with_retry(fn: Callable[[], Awaitable[T]], *, url: str, operation: str, rank: int | None = None,
                           endpoint: str | None = None, conditional: bool = False,
                           policy: RetryPolicy = DEFAULT_RETRY) -> T:
    """The coroutine version of :func:`call_with_retry` (``fn`` returns a fresh awaitable per try)."""
    start, delays, attempt = time.monotonic(), policy.delays(), 0
    while True:
        attempt += 1
        try:
            return await fn()
        except Exception as exc:  # noqa: BLE001 - every failure leaves as a typed error
            await asyncio.sleep(_retry_delay(exc, delays, start, attempt, policy, url=url, operation=operation,
                                             rank=rank, endpoint=endpoint, conditional=conditional))


class NoSuchKey(Exception):
    """Internal: the object (or prefix) asked for does not exist; callers turn it into the error
    that says what was missing (CheckpointNotFoundError, DataFileMissingError...)."""
