"""Pre-flight of an object store: before the first byte of a save to ``s3://bucket/prefix``.

Four questions, in order, each answered with a typed error (distckpt.storage.object.errors) naming the
URL, the rank and a remedy:

  endpoint     the endpoint answers: a TCP connection to its host and port opens within a bound
               (a wrong AWS_ENDPOINT_URL or a server that is down).  -> EndpointUnreachableError
  credentials  credentials resolve (storage_options key/secret, the AWS variables, a profile, an
               instance role; or ``anon=True``), without sending a request.
               -> ObjectStoreAccessError (code NoCredentialsError)
  bucket       the bucket exists and the credentials may list it: one ListObjectsV2 of the
               checkpoint prefix, MaxKeys=1. -> BucketNotFoundError / ObjectStoreAccessError
               (wrong key, wrong secret, no permission)
  writable     a probe object is created next to the checkpoint (a conditional create:
               If-None-Match: *), created again to see whether the server honours conditional
               creates (it must refuse), then deleted (and checked gone). -> ObjectStoreAccessError
               (a read-only key), QuotaExceededError, ObjectStoreError. A server that overwrote the
               probe is reported (``conditional`` False): distckpt's commit then needs
               DISTCKPT_OBJECT_CONDITIONAL=0.

:func:`check_object_store` runs them and raises the first failure; :func:`run_checks` returns each
one's outcome, which :mod:`distckpt.checks.objectstore` turns into report rows (what
``distckpt preflight s3://...`` prints).
Only s3fs file systems get the S3-level checks; another fsspec store gets the probe through
fsspec's own calls (pipe_file, info, rm_file).

Invariant: the probe is always removed (also when a step after its creation fails); nothing else
is written.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import socket
import time
import uuid
from typing import Any, Mapping
from urllib.parse import urlsplit

from ...errors import DistCkptError, EndpointUnreachableError, ObjectStoreAccessError, ObjectStoreError
from .errors import client_config, translate
from .request import run

__all__ = ["check_object_store", "run_checks", "PROBE_PREFIX"]

PROBE_PREFIX = ".distckpt-probe-"
CONNECT_TIMEOUT_S = 5.0


def _split(url: str) -> tuple[str, str, str]:
    """(protocol, bucket, key prefix) of ``s3://bucket/a/b``."""
    protocol, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    return protocol, bucket, key.strip("/")


def _open_fs(url: str, storage_options: Mapping[str, Any] | None):
    import fsspec

    options: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
    options.update(storage_options or {})
    if url.startswith("s3://"):
        options["config_kwargs"] = {**client_config(connect_timeout_s=CONNECT_TIMEOUT_S, read_timeout_s=30),
                                    **dict(options.get("config_kwargs") or {})}
    fs, _ = fsspec.core.url_to_fs(url, **options)
    return fs


def _endpoint_of(fs) -> str | None:
    """The endpoint URL the client will use (after connecting: the resolved regional one)."""
    with contextlib.suppress(Exception):
        return fs.s3.meta.endpoint_url  # s3fs, after connect()
    kwargs = getattr(fs, "client_kwargs", None) or {}
    return kwargs.get("endpoint_url") or getattr(fs, "endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")


def _check_endpoint(url: str, endpoint: str, rank: int | None) -> str:
    parts = urlsplit(endpoint)
    host = parts.hostname or endpoint
    port = parts.port or (443 if parts.scheme == "https" else 80)
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        code = exc.errno if isinstance(exc.errno, int) else (_errno.ETIMEDOUT if isinstance(exc, TimeoutError)
                                                            else _errno.EHOSTUNREACH)
        raise EndpointUnreachableError(
            f"the object store endpoint {endpoint} does not answer: connecting to {host}:{port} failed "
            f"({type(exc).__name__}: {exc})", path=url, rank=rank, errno=code, url=url, operation="connect",
            code=type(exc).__name__, status=None, endpoint=endpoint) from exc
    return f"{endpoint} answers ({host}:{port} connected in {(time.monotonic() - t0) * 1000:.0f} ms)"


def _credentials(fs, url: str, rank: int | None) -> str:
    """Where the credentials come from; raises when there are none."""
    if getattr(fs, "anon", False):
        return "anonymous (unsigned requests: anon=True)"
    ck = getattr(fs, "client_kwargs", None) or {}
    if getattr(fs, "key", None) or ck.get("aws_access_key_id"):
        return "explicit (storage_options key/secret)"
    import fsspec.asyn

    fs.connect()
    creds = fsspec.asyn.sync(fs.loop, fs.session.get_credentials, timeout=CONNECT_TIMEOUT_S * 3)
    if creds is None:
        raise ObjectStoreAccessError(
            f"no credentials for the object store were found for {url}: none in storage_options, the AWS "
            "variables, the shared credentials/config files or an instance role", path=url, rank=rank,
            errno=_errno.EACCES, url=url, operation="resolve credentials", code="NoCredentialsError",
            status=None, endpoint=_endpoint_of(fs),
            remedy="Provide credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or "
                   "storage_options={'key': ..., 'secret': ...}; anon=True for a public bucket.")
    return f"resolved by botocore ({getattr(creds, 'method', 'unknown source')})"


def run_checks(url: str, storage_options: Mapping[str, Any] | None, rank: int | None, probe: bool,
                fs=None) -> list[tuple[str, str | None, dict, BaseException | None]]:
    """[(check name, ok message or None, details, error or None)]; stops at the first error."""
    out: list[tuple[str, str | None, dict, BaseException | None]] = []
    protocol, bucket, prefix = _split(url)
    try:
        fs = fs if fs is not None else _open_fs(url, storage_options)
    except Exception as exc:  # noqa: BLE001 - an unknown scheme, a bad option
        out.append(("object_endpoint", None, {}, ObjectStoreError(
            f"cannot open {url} with fsspec: {type(exc).__name__}: {exc}", path=url, rank=rank, errno=_errno.EINVAL,
            url=url, operation="open", code=type(exc).__name__, status=None, endpoint=None,
            remedy="Install the fsspec back end of that scheme (s3fs for s3://) and pass storage_options it knows.")))
        return out
    is_s3 = hasattr(fs, "call_s3")

    def step(name, fn):
        try:
            msg, details = fn()
        except Exception as exc:  # noqa: BLE001 - every failure leaves typed
            err = exc if isinstance(exc, DistCkptError) else translate(
                exc, url=url, operation=name.replace("object_", ""), rank=rank, endpoint=_endpoint_of(fs))
            out.append((name, None, {}, err))
            return False
        out.append((name, msg, details, None))
        return True

    if is_s3:
        if not step("object_credentials", lambda: (_credentials(fs, url, rank), {})):
            return out
        fs.connect()
        endpoint = _endpoint_of(fs)
        if endpoint and not step("object_endpoint",
                                 lambda: (_check_endpoint(url, endpoint, rank), {"endpoint": endpoint})):
            return out

        def bucket_check():
            run(fs.loop, lambda: fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1),
                url=url, operation="list bucket", rank=rank, endpoint=endpoint)
            return f"bucket {bucket!r} exists and may be listed", {"bucket": bucket}
        if not step("object_bucket", bucket_check):
            return out
    if probe:
        step("object_writable", lambda: _probe(fs, url, protocol, bucket, prefix, rank, is_s3))
    return out


def _probe(fs, url: str, protocol: str, bucket: str, prefix: str, rank: int | None, is_s3: bool):
    name = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    key = f"{prefix}/{name}" if prefix else name
    probe_url = f"{protocol}://{bucket}/{key}"
    endpoint = _endpoint_of(fs)
    # From the first create on, the probe may exist (a request whose answer was lost may have
    # landed): the finally below deletes it on every path. A leftover probe was never removed.
    created = True
    try:
        if is_s3:
            def put(body):
                return lambda: fs._call_s3("put_object", Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")
            try:
                run(fs.loop, put(b"distckpt probe"), url=probe_url, operation="create probe object", rank=rank,
                    endpoint=endpoint, conditional=True)
            except FileExistsError:
                # The name is this call's own (host, pid, random): a refused create is the client's
                # retry of one whose answer was lost after it landed (the save used to fail with
                # PreconditionFailed). It is there, as created.
                pass
            try:  # again: a server that honours If-None-Match must refuse
                run(fs.loop, put(b"distckpt probe 2"), url=probe_url, operation="create probe object again",
                    rank=rank, endpoint=endpoint, conditional=True)
                conditional = False
            except FileExistsError:  # CheckpointExistsError: the precondition failed, as it must
                conditional = True
            run(fs.loop, lambda: fs._call_s3("delete_object", Bucket=bucket, Key=key), url=probe_url,
                operation="delete probe object", rank=rank, endpoint=endpoint)
        else:
            run(fs.loop, lambda: fs._pipe_file(f"{bucket}/{key}", b"distckpt probe"), url=probe_url,
                operation="create probe object", rank=rank)
            conditional = None
            run(fs.loop, lambda: fs._rm_file(f"{bucket}/{key}"), url=probe_url, operation="delete probe object",
                rank=rank)
        created = False
        fs.invalidate_cache()
        if run(fs.loop, lambda: fs._exists(f"{bucket}/{key}"), url=probe_url, operation="check the probe is gone",
               rank=rank, endpoint=endpoint):
            raise ObjectStoreError(f"the probe object {probe_url} is still there after it was deleted",
                                   path=probe_url, rank=rank, errno=_errno.EIO, url=probe_url,
                                   operation="delete probe object", code=None, status=None, endpoint=endpoint,
                                   remedy="The store did not delete an object: check its versioning / object-lock "
                                          "settings; distckpt deletes old checkpoints and leftovers.")
    finally:
        if created:
            with contextlib.suppress(Exception):
                run(fs.loop, lambda: fs._rm_file(f"{bucket}/{key}"), url=probe_url, operation="delete probe object",
                    rank=rank, endpoint=endpoint)
    where = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    msg = f"{where} is writable (probe object created and deleted)"
    if conditional is False:
        msg += ("; the server does NOT honour conditional creates (If-None-Match: *): set "
                "DISTCKPT_OBJECT_CONDITIONAL=0 so the commit uses its read-back check")
    elif conditional:
        msg += "; conditional creates (If-None-Match: *) are honoured"
    return msg, {"probe": probe_url, "conditional": conditional}


def check_object_store(url: str, *, storage_options: Mapping[str, Any] | None = None, rank: int | None = None,
                       probe: bool = True, fs=None) -> dict:
    """Check that a save to ``url`` can start: credentials, endpoint, bucket, and (``probe``) a
    write + delete of a probe object. Returns details: ``endpoint``, ``bucket``, ``conditional``
    (whether the server honours If-None-Match: *; None when unknown).

    Raises:
        EndpointUnreachableError: the endpoint does not answer.
        ObjectStoreAccessError: no credentials, wrong key or secret, no permission to list or write.
        BucketNotFoundError: the bucket does not exist.
        QuotaExceededError, ThrottledError, ObjectStoreError: the probe write failed so.
    """
    details: dict = {}
    for _name, _msg, d, err in run_checks(url, storage_options, rank, probe, fs=fs):
        if err is not None:
            raise err
        details.update(d)
    return details
