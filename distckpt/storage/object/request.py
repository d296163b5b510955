"""One object-store request: a deadline of distckpt's own, bounded retries of throttles, a typed error.

Why a deadline of our own: the client stack's timeouts do not cover every request. With s3fs /
aiobotocore / aiohttp, ``read_timeout`` bounds a GET or a HEAD whose answer stalls, but a request
with a body (PutObject, UploadPart, the MANIFEST's conditional create) whose answer never comes
waits forever: a stopped server, a hung gateway or a black-holing middlebox hung a save, and its
lease heartbeat kept every other save of the root out for as long as the process lived. So every
request distckpt makes runs as a coroutine on the file system's event loop under
``asyncio.wait_for``: past its deadline it is cancelled (aiohttp closes the connection) and the
caller gets :class:`~distckpt.errors.EndpointUnreachableError` (errno ETIMEDOUT). The deadline
covers the client's own internal retries of that request.

The deadline of one request is ``DISTCKPT_OBJECT_REQUEST_TIMEOUT_S`` (default 30 s) plus the time
its body takes at ``DISTCKPT_OBJECT_MIN_RATE`` (default 4 MiB/s): a 16 MiB part gets 34 s, a
MANIFEST of 1 MiB 30.25 s. A throttled request is retried (:mod:`distckpt.storage.object.errors`,
at most ``RetryPolicy.total_s`` = 60 s of retries), each try with the full deadline; so one call
returns or raises within ``deadline + 60 s + one deadline``, and a silent endpoint is reported
within one deadline.

:func:`in_flight_overdue` tells the lease heartbeat whether a request of this process is stuck past
its deadline (its cancellation did not take, e.g. the event loop itself is blocked): a save in
that state must stop renewing its lease, so that other saves can take the root over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno as _errno
import itertools
import os
import threading
import time
from typing import Any, Awaitable, Callable, TypeVar

from ...errors import ConfigError, EndpointUnreachableError
from .errors import DEFAULT_RETRY, acall_with_retry

__all__ = ["request_timeout", "run", "arun", "submit", "wait", "in_flight_overdue", "env_float",
           "RequestDeadlineExceeded"]

T = TypeVar("T")

_GRACE_S = 5.0  # how long past its deadline a cancelled request may take to unwind


class RequestDeadlineExceeded(TimeoutError):
    """Internal: a request got no answer within distckpt's deadline (translated to
    EndpointUnreachableError by :func:`distckpt.storage.object.errors.translate`)."""


def env_float(name: str, default: float, lo: float, hi: float) -> float:
    """The number in the environment variable ``name`` (``default`` when unset or empty).

    Raises:
        ConfigError: not a number, or outside [lo, hi].
    """
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number", variable=name) from None
    if not lo <= v <= hi:
        raise ConfigError(f"{name}={v} must be between {lo} and {hi}", variable=name)
    return v


def request_timeout(nbytes: int = 0) -> float:
    """Seconds one request that sends or receives ``nbytes`` may take before it is abandoned:
    ``DISTCKPT_OBJECT_REQUEST_TIMEOUT_S`` (default 30, 0.5 to 86400) plus ``nbytes`` at
    ``DISTCKPT_OBJECT_MIN_RATE`` bytes per second (default 4 MiB/s, at least 64 KiB/s).

    Raises:
        ConfigError: a variable is not a number or out of range.
    """
    base = env_float("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", 30.0, 0.5, 86400.0)
    rate = _env_rate("DISTCKPT_OBJECT_MIN_RATE", 4 << 20, 64 << 10, 1 << 40)
    return base + max(0, nbytes) / rate


def _env_rate(name: str, default: int, lo: int, hi: int) -> int:
    """Bytes per second in ``name``, a size in binary units as every size variable takes (``64K``,
    ``4M``, ``4194304``), or a plain number as the variable took before it took sizes
    (``4194304.0``, ``4e6``: rounded down); ``default`` when unset or empty.

    Raises:
        ConfigError: neither, or outside [lo, hi]."""
    import math

    from ...sizes import parse_size

    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        v = parse_size(raw)
    except ValueError as exc:
        try:
            number = float(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: {exc}", variable=name) from None
        if not math.isfinite(number):
            raise ConfigError(f"{name}={raw!r}: {exc}", variable=name) from None
        v = int(number)
    if not lo <= v <= hi:
        raise ConfigError(f"{name}={raw!r} must be between {lo} and {hi} bytes per second", variable=name)
    return v


# Requests in flight in this process: id -> monotonic time by which each must have ended.
_in_flight: dict[int, float] = {}
_in_flight_lock = threading.Lock()
_ids = itertools.count()


def in_flight_overdue(now: float | None = None) -> float:
    """How many seconds the most overdue request in flight in this process is past its deadline
    plus the grace its cancellation may take (0.0 when none is)."""
    now = time.monotonic() if now is None else now
    with _in_flight_lock:
        worst = min(_in_flight.values(), default=now)  # the earliest end: the most overdue request
    return max(0.0, now - worst)


async def _attempt(make: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    key = next(_ids)
    with _in_flight_lock:
        _in_flight[key] = time.monotonic() + timeout_s + _GRACE_S
    try:
        return await asyncio.wait_for(make(), timeout_s)
    except asyncio.TimeoutError:
        raise RequestDeadlineExceeded(
            _errno.ETIMEDOUT, f"no answer within {timeout_s:.1f} s (distckpt's request deadline: DISTCKPT_OBJECT_REQUEST_TIMEOUT_S "
            f"plus the body at DISTCKPT_OBJECT_MIN_RATE)") from None
    finally:
        with _in_flight_lock:
            _in_flight.pop(key, None)


async def arun(make: Callable[[], Awaitable[T]], *, url: str, operation: str, rank: int | None = None,
               endpoint: str | None = None, conditional: bool = False, timeout_s: float | None = None,
               nbytes: int = 0) -> T:
    """The coroutine of :func:`run`, for code already on the event loop (``make`` returns a fresh
    awaitable per try)."""
    timeout = request_timeout(nbytes) if timeout_s is None else timeout_s
    return await acall_with_retry(lambda: _attempt(make, timeout), url=url, operation=operation, rank=rank,
                                  endpoint=endpoint, conditional=conditional)


def submit(loop: asyncio.AbstractEventLoop, make: Callable[[], Awaitable[T]], **kw: Any) -> concurrent.futures.Future:
    """Start :func:`arun` on ``loop`` (the file system's event loop thread); the future's result
    is the request's, or its typed error."""
    return asyncio.run_coroutine_threadsafe(arun(make, **kw), loop)


def wait(fut: concurrent.futures.Future, *, timeout_s: float, url: str, operation: str, rank: int | None = None,
         endpoint: str | None = None) -> Any:
    """``fut.result()``, but never longer than ``timeout_s`` plus the throttle retries' bound:
    a future that outlives that (the event loop itself is stuck) is cancelled and reported as
    EndpointUnreachableError."""
    backstop = DEFAULT_RETRY.total_s + 2 * timeout_s + _GRACE_S
    try:
        return fut.result(timeout=backstop)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise EndpointUnreachableError(
            f"{operation} {url} failed: no answer within {backstop:.0f} s and the request could not be cancelled "
            f"(the I/O event loop is stuck)", path=url, rank=rank, url=url, operation=operation, endpoint=endpoint,
            code="RequestDeadlineExceeded", errno=_errno.ETIMEDOUT) from None


def run(loop: asyncio.AbstractEventLoop, make: Callable[[], Awaitable[T]], *, url: str, operation: str,
        rank: int | None = None, endpoint: str | None = None, conditional: bool = False,
        timeout_s: float | None = None, nbytes: int = 0) -> T:
    """Run the request ``make()`` on ``loop`` from a thread that is not the loop's, under a
    deadline (``timeout_s``, else :func:`request_timeout` of ``nbytes``), retrying throttles.

    Returns what the request returns.

    Raises:
        EndpointUnreachableError: no answer within the deadline (or the connection failed).
        DistCkptError: any other failure, typed by :func:`distckpt.storage.object.errors.translate`
            (CheckpointExistsError for a failed conditional create when ``conditional``).
    """
    timeout = request_timeout(nbytes) if timeout_s is None else timeout_s
    fut = submit(loop, make, url=url, operation=operation, rank=rank, endpoint=endpoint, conditional=conditional,
                 timeout_s=timeout)
    return wait(fut, timeout_s=timeout, url=url, operation=operation, rank=rank, endpoint=endpoint)
