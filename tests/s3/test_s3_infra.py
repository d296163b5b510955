"""The S3 test server and the object-store error translation, against a real server (SeaweedFS).

What the server does (and so what distckpt's object-store back end may rely on) is checked here:
access keys are enforced, a missing bucket is not created on write, conditional creates
(If-None-Match: *) are honoured on PutObject and CompleteMultipartUpload, and the
``s3_ignore_conditional`` fixture really makes the server overwrite. Every failure the store can
produce here becomes a typed error (distckpt.storage.object.errors.translate) that names the URL, the
rank and a remedy: bad keys, a read-only key, no credentials, a missing bucket or object, the
server stopped (SIGTERM) or killed in the middle of an upload, real throttling (SeaweedFS's circuit
breaker answers 503) with the bounded retry, and an over-quota bucket.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch

import distckpt
from distckpt import errors
from distckpt.storage.object import errors as objerrors
from distckpt.storage.object.errors import RetryPolicy, call_with_retry, translate

pytestmark = pytest.mark.timeout(180)

NO_RETRY = {"retries": {"max_attempts": 1, "mode": "standard"}}


def _raised(fn) -> BaseException:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the point is to look at it
        return exc
    raise AssertionError("expected the store to refuse")


def _typed(fn, url, operation="read", **kw) -> errors.DistCkptError:
    err = translate(_raised(fn), url=url, operation=operation, rank=3, **kw)
    text = str(err)
    assert url in text and "rank 3" in text and "Remedy:" in text, text
    assert pickle.loads(pickle.dumps(err)).__class__ is err.__class__
    return err


def test_keys_enforced_and_refusals_typed(s3_bucket, monkeypatch, tmp_path):
    server, b = s3_bucket.server, s3_bucket.name
    s3_bucket.fs.pipe(f"{b}/obj", b"payload")
    url = f"s3://{b}/obj"

    bad_secret = server.filesystem(secret="not-the-secret")
    err = _typed(lambda: bad_secret.cat(f"{b}/obj"), url)  # a HEAD first: 403 with no error body
    assert isinstance(err, errors.ObjectStoreAccessError) and isinstance(err, PermissionError)
    assert err.status == 403
    err = _typed(lambda: bad_secret.pipe(f"{b}/new", b"1"), f"s3://{b}/new", "write")
    assert isinstance(err, errors.ObjectStoreAccessError)
    assert err.code == "SignatureDoesNotMatch" and err.status == 403 and "secret is wrong" in str(err)

    unknown_key = server.filesystem(key="nobody", secret="x")
    err = _typed(lambda: unknown_key.pipe(f"{b}/new", b"1"), f"s3://{b}/new", "write")
    assert isinstance(err, errors.ObjectStoreAccessError)
    assert err.code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")

    anonymous = server.filesystem(anon=True, key=None, secret=None)
    assert isinstance(_typed(lambda: anonymous.cat(f"{b}/obj"), url), errors.ObjectStoreAccessError)

    read_only = server.filesystem(**server.storage_options(read_only=True))
    assert read_only.cat(f"{b}/obj") == b"payload"  # the read-only key reads ...
    err = _typed(lambda: read_only.pipe(f"{b}/new", b"1"), f"s3://{b}/new", "write")
    assert isinstance(err, errors.ObjectStoreAccessError) and err.code == "AccessDenied"  # ... but not write
    assert "do not grant" in str(err)

    # No credentials anywhere (no variables, no files, no instance metadata): botocore's own error.
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_creds = server.filesystem(key=None, secret=None)
    err = _typed(lambda: no_creds.cat(f"{b}/obj"), url)
    assert isinstance(err, errors.ObjectStoreAccessError) and err.code == "NoCredentialsError"
    assert "AWS_ACCESS_KEY_ID" in err.remedy


def test_missing_bucket_and_object_typed(s3_bucket):
    fs, b = s3_bucket.fs, s3_bucket.name
    # The server creates no bucket on write (-s3.autoCreateBucket=false): a missing bucket is real.
    err = _typed(lambda: fs.pipe("no-such-bucket-distckpt/x", b"1"), "s3://no-such-bucket-distckpt/x", "write")
    assert isinstance(err, errors.BucketNotFoundError) and isinstance(err, FileNotFoundError)
    assert err.bucket == "no-such-bucket-distckpt" and "Create the bucket" in err.remedy
    assert "no-such-bucket-distckpt" not in fs.ls("", refresh=True)
    err = _typed(lambda: fs.cat("no-such-bucket-distckpt/x"), "s3://no-such-bucket-distckpt/x")
    assert isinstance(err, errors.BucketNotFoundError)
    err = _typed(lambda: fs.cat(f"{b}/absent"), f"s3://{b}/absent")
    assert isinstance(err, errors.ObjectNotFoundError) and not isinstance(err, errors.BucketNotFoundError)


def _xb(fs, path, data, block_size=5 << 20):
    with fs.open(path, "xb", block_size=block_size) as f:
        f.write(data)


def test_conditional_create_honoured(s3_bucket):
    """SeaweedFS refuses a second conditional create, single PUT and multipart alike, and exactly
    one of several racing writers wins. Recorded in docs/OBJECT_STORES.md."""
    fs, b = s3_bucket.fs, s3_bucket.name
    _xb(fs, f"{b}/one", b"first")
    err = _typed(lambda: _xb(fs, f"{b}/one", b"second"), f"s3://{b}/one", "write MANIFEST", conditional=True)
    assert isinstance(err, errors.CheckpointExistsError) and isinstance(err, FileExistsError)
    assert "another writer" in str(err)
    assert fs.cat(f"{b}/one") == b"first"
    # Without conditional=True the same refusal is a plain store error (PreconditionFailed).
    assert type(_typed(lambda: _xb(fs, f"{b}/one", b"x"), f"s3://{b}/one")) is errors.ObjectStoreError

    # Multipart: CompleteMultipartUpload with If-None-Match: * loses to an existing object.
    big = os.urandom(11 << 20)
    _xb(fs, f"{b}/mp", big)
    err = _typed(lambda: _xb(fs, f"{b}/mp", os.urandom(11 << 20)), f"s3://{b}/mp", "write", conditional=True)
    assert isinstance(err, errors.CheckpointExistsError)
    assert fs.cat(f"{b}/mp") == big

    # A race of 6 single-PUT writers and of 2 multipart uploads completed one after the other.
    def put(i):
        try:
            _xb(fs, f"{b}/race", b"writer-%d" % i)
            return i
        except OSError:
            return None
    with cf.ThreadPoolExecutor(6) as pool:
        winners = [i for i in pool.map(put, range(6)) if i is not None]
    assert len(winners) == 1 and fs.cat(f"{b}/race") == b"writer-%d" % winners[0]
    uploads = [fs.call_s3("create_multipart_upload", Bucket=b, Key="mprace")["UploadId"] for _ in range(2)]
    parts = [fs.call_s3("upload_part", Bucket=b, Key="mprace", UploadId=u, PartNumber=1, Body=bytes([65 + i]) * 100)
             for i, u in enumerate(uploads)]

    def complete(i):
        fs.call_s3("complete_multipart_upload", Bucket=b, Key="mprace", UploadId=uploads[i], IfNoneMatch="*",
                   MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": parts[i]["ETag"]}]})
    complete(0)
    assert isinstance(_typed(lambda: complete(1), f"s3://{b}/mprace", "commit", conditional=True),
                      errors.CheckpointExistsError)
    assert fs.cat(f"{b}/mprace") == b"A" * 100
    fs.call_s3("abort_multipart_upload", Bucket=b, Key="mprace", UploadId=uploads[1])


def test_ignore_conditional_fixture_makes_the_server_overwrite(s3_bucket, s3_ignore_conditional):
    """The fallback path's test switch: the header is dropped, here and in child processes."""
    fs = s3_bucket.server.filesystem()
    b = s3_bucket.name
    _xb(fs, f"{b}/k", b"first")
    _xb(fs, f"{b}/k", b"second")  # no error: the server did not see If-None-Match
    assert fs.cat(f"{b}/k") == b"second"
    code = ("import s3fs, sys, json; fs = s3fs.S3FileSystem(**json.loads(sys.argv[1]));"
            f"f = fs.open('{b}/k', 'xb'); f.write(b'third'); f.close(); print(fs.cat('{b}/k').decode())")
    import json
    out = subprocess.run([sys.executable, "-c", code, json.dumps(s3_bucket.storage_options)],
                         capture_output=True, text=True, timeout=60, env=os.environ.copy())
    assert out.returncode == 0 and out.stdout.strip() == "third", out.stderr


def test_server_stopped_or_killed_gives_typed_error_in_time(s3_private_server):
    """A server that goes away (SIGKILL in the middle of a multipart upload, or SIGTERM) gives
    EndpointUnreachableError within a bound, never a hang."""
    bucket = s3_private_server
    server, b = bucket.server, bucket.name
    fs = server.filesystem(config_kwargs=objerrors.client_config(connect_timeout_s=2, read_timeout_s=5))
    fs.pipe(f"{b}/before", b"x")
    url = f"s3://{b}/big"
    started, outcome = threading.Event(), {}

    def upload():
        try:
            with fs.open(f"{b}/big", "wb", block_size=5 << 20) as f:
                for _ in range(64):
                    f.write(os.urandom(1 << 20))
                    started.set()
        except Exception as exc:  # noqa: BLE001
            outcome["exc"] = exc
            outcome["t"] = time.monotonic()

    t = threading.Thread(target=upload)
    t.start()
    assert started.wait(30)
    time.sleep(0.2)
    killed_at = time.monotonic()
    server.kill()
    t.join(60)
    assert not t.is_alive(), "the upload hung after the server died"
    assert "exc" in outcome, "the upload succeeded against a dead server"
    err = translate(outcome["exc"], url=url, operation="upload part", rank=1, endpoint=server.endpoint)
    assert isinstance(err, errors.EndpointUnreachableError) and isinstance(err, ConnectionError), repr(err)
    assert server.endpoint in str(err) and "rank 1" in str(err)
    assert outcome["t"] - killed_at < 45

    # Once the server is gone, a read fails the same way, within the timeout (retries included).
    server.stop(remove=False)
    t0 = time.monotonic()
    err = _typed(lambda: fs.cat(f"{b}/before"), f"s3://{b}/before", endpoint=server.endpoint)
    assert isinstance(err, errors.EndpointUnreachableError) and err.errno in (111, 113, 110)
    assert time.monotonic() - t0 < 30


def test_throttling_is_retried_then_typed(s3_private_server):
    """Real throttling: SeaweedFS's circuit breaker with a write limit of 0 requests in flight
    answers every write 503 ErrTooManyRequest (reads still work). distckpt's bounded backoff
    retries it, raises ThrottledError when attempts or time run out, and gets through once the
    server lets writes in again."""
    server, b = s3_private_server.server, s3_private_server.name
    fs = server.filesystem(config_kwargs=NO_RETRY)  # no botocore retries: distckpt's own bound only
    fs.retries = 1
    tries = [0]

    def once():
        tries[0] += 1
        fs.pipe(f"{b}/obj", b"data")

    server.throttle(writes=0)
    try:
        err = _raised(lambda: call_with_retry(once, url=f"s3://{b}/obj", operation="upload", rank=0,
                                              policy=RetryPolicy(attempts=3, base_s=0.01, max_s=0.05)))
        assert isinstance(err, errors.ThrottledError), repr(err)
        assert tries[0] == 3 and err.attempts == 3 and err.status == 503 and err.code == "ErrTooManyRequest"
        assert "after 3 tries" in str(err) and "rank 0" in str(err) and "Remedy:" in str(err)

        tries[0] = 0  # the time bound stops a policy with many attempts left
        t0 = time.monotonic()
        err = _raised(lambda: call_with_retry(once, url=f"s3://{b}/obj", operation="upload", rank=0,
                                              policy=RetryPolicy(attempts=1000, base_s=0.1, max_s=0.3, total_s=2)))
        assert isinstance(err, errors.ThrottledError) and 1 < err.attempts < 1000
        assert time.monotonic() - t0 < 6 and err.waited_s < 4  # no retry begins after 2 s

        tries[0] = 0  # the server lets writes in again after a second: the retries get through
        lift = threading.Timer(1.0, server.unthrottle)
        lift.start()
        call_with_retry(once, url=f"s3://{b}/obj", operation="upload", rank=0,
                        policy=RetryPolicy(attempts=60, base_s=0.05, max_s=0.5, total_s=60))
        lift.join()
        assert tries[0] > 1 and fs.cat(f"{b}/obj") == b"data"
    finally:
        server.unthrottle()


@pytest.mark.timeout(300)
def test_quota(s3_private_server):
    """An over-quota bucket: SeaweedFS makes it read-only and answers a write with InternalError
    (500), which says nothing about quota, so distckpt reports an ObjectStoreError with the
    server's words (it cannot know better). Stores that do say it (Ceph RGW QuotaExceeded 403,
    MinIO XMinioStorageFull 507) give QuotaExceededError; they cannot run here, so those two
    responses are built by hand below (the only mock in this file)."""
    # A server of its own: the session server's quota accounting walks every bucket the suite
    # made, and a `weed shell` against it once blocked past this test's timeout on a loaded machine.
    server, fs, b = s3_private_server.server, s3_private_server.fs, s3_private_server.name
    server.shell(f"s3.bucket.quota -name {b} -op set -sizeMB 1")
    fs.pipe(f"{b}/big", os.urandom(3 << 20))
    # The server's own background accounting is slow on a loaded machine: poll it, each shell
    # bounded, the whole wait well inside the test's timeout (300 s).
    deadline = time.monotonic() + 200
    while True:
        try:
            if "read only" in server.shell("s3.bucket.quota.enforce -apply", timeout_s=30):
                break
        except subprocess.TimeoutExpired:
            pass
        assert time.monotonic() < deadline, ("SeaweedFS never noticed the bucket was over quota; its log: "
                                                f"{server.log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(1)
    nofs = server.filesystem(config_kwargs=NO_RETRY)
    nofs.retries = 1
    err = _typed(lambda: nofs.pipe(f"{b}/more", b"x"), f"s3://{b}/more", "write")
    assert type(err) is errors.ObjectStoreError and err.status == 500 and err.code == "InternalError"
    assert fs.cat(f"{b}/big")[:1] is not None  # what was there is still readable

    from botocore.exceptions import ClientError
    for code, status in (("QuotaExceeded", 403), ("XMinioStorageFull", 507)):
        exc = ClientError({"Error": {"Code": code, "Message": "full"},
                           "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
        err = translate(exc, url="s3://bucket/k", operation="write", rank=2)
        assert isinstance(err, errors.QuotaExceededError) and isinstance(err, errors.DiskFullError)
        assert "quota" in err.remedy and "rank 2" in str(err)


# ------------------------------------------------------------------------------------------------
# Pre-flight of an object store (distckpt.storage.object.check through distckpt.checks)


def _object_checks(report):
    return {r.name: r for r in report.checks if r.name.startswith("object_")}


def test_preflight_object_store_ok_and_probe_removed(s3_bucket):
    from distckpt.checks import preflight

    url = f"{s3_bucket.url}/run7/step_00000100"
    report = preflight(url, storage_options=s3_bucket.storage_options, env={})
    checks = _object_checks(report)
    assert set(checks) == {"object_credentials", "object_endpoint", "object_bucket", "object_writable"}
    assert all(c.ok for c in checks.values()), str(report)
    assert report.ok, str(report)
    assert "disk" not in {r.name for r in report.checks}  # no local file-system checks for a URL
    assert checks["object_writable"].details["conditional"] is True
    assert "explicit" in checks["object_credentials"].message
    assert s3_bucket.keys() == [], "the probe object was left behind"


def test_preflight_object_store_without_conditional_creates(s3_bucket, s3_ignore_conditional):
    from distckpt.checks import preflight

    report = preflight(f"{s3_bucket.url}/run7", storage_options=s3_bucket.storage_options, env={})
    writable = _object_checks(report)["object_writable"]
    assert writable.ok and writable.details["conditional"] is False
    assert "DISTCKPT_OBJECT_CONDITIONAL=0" in writable.message
    assert s3_bucket.keys() == []


def test_preflight_object_store_failures_typed(s3_bucket, monkeypatch, tmp_path):
    from distckpt.checks import preflight
    from distckpt.storage.object.check import check_object_store
    from tests.helpers.s3server import _free_ports

    server, url = s3_bucket.server, f"{s3_bucket.url}/run7"

    def failing(check, cls, **options):
        report = preflight(url if "url" not in options else options.pop("url"), storage_options=options, env={})
        assert not report.ok
        result = _object_checks(report)[check]
        assert result.status == "error" and isinstance(result.error, cls), str(report)
        with pytest.raises(cls) as info:
            report.raise_first()
        assert "Remedy:" in str(info.value)
        return result.error

    err = failing("object_bucket", errors.ObjectStoreAccessError, **server.storage_options(secret="wrong"))
    assert err.code == "SignatureDoesNotMatch"
    err = failing("object_writable", errors.ObjectStoreAccessError, **server.storage_options(read_only=True))
    assert err.code == "AccessDenied"
    err = failing("object_bucket", errors.BucketNotFoundError, url="s3://no-such-bucket-distckpt/run7",
                  **server.storage_options())
    assert err.bucket == "no-such-bucket-distckpt"
    dead = f"http://127.0.0.1:{_free_ports(1)[0]}"
    t0 = time.monotonic()
    err = failing("object_endpoint", errors.EndpointUnreachableError,
                  **server.storage_options(client_kwargs={"endpoint_url": dead, "region_name": "us-east-1"}))
    assert dead in str(err) and time.monotonic() - t0 < 15
    assert s3_bucket.keys() == []

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(errors.ObjectStoreAccessError, match="no credentials") as info:
        check_object_store(url, storage_options={"client_kwargs": {"endpoint_url": server.endpoint}}, rank=5)
    assert info.value.code == "NoCredentialsError" and info.value.rank == 5


def test_preflight_cli_on_s3_url(s3_bucket):
    """`distckpt preflight s3://...` with the standard AWS variables: exit 0 and the object rows;
    a read-only key: exit 1 naming the refusal."""
    url = f"{s3_bucket.url}/run7"
    env = {**os.environ, **s3_bucket.server.env()}
    out = subprocess.run([sys.executable, "-m", "distckpt", "preflight", url, "--json"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    import json
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert checks["object_writable"]["status"] == "ok" and checks["object_bucket"]["status"] == "ok"
    env = {**os.environ, **s3_bucket.server.env(read_only=True)}
    out = subprocess.run([sys.executable, "-m", "distckpt", "preflight", url], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "object_writable" in out.stdout and "Access Denied" in out.stdout, out.stdout
    assert s3_bucket.keys() == []


def test_save_runs_the_object_preflight_first(s3_bucket, s3_ignore_conditional, monkeypatch):
    """save() checks the store before its first byte: a read-only key fails with the typed error
    and leaves no object (no lease, no data); a server that ignores If-None-Match while
    DISTCKPT_OBJECT_CONDITIONAL=1 is refused with the remedy, and with =0 the save goes through."""
    import distckpt
    import torch

    url = f"{s3_bucket.url}/run/step_00000001"
    sd = {"w": torch.arange(1000.0)}
    with pytest.raises(errors.ObjectStoreAccessError) as info:
        distckpt.save(sd, url, storage_options=s3_bucket.server.storage_options(read_only=True))
    assert info.value.code == "AccessDenied" and s3_bucket.keys() == []
    with pytest.raises(errors.ConfigError, match="does not honour conditional creates") as info:
        distckpt.save(sd, url, storage_options=s3_bucket.storage_options)
    assert "DISTCKPT_OBJECT_CONDITIONAL=0" in info.value.remedy and s3_bucket.keys() == []
    monkeypatch.setenv("DISTCKPT_OBJECT_CONDITIONAL", "0")
    distckpt.save(sd, url, storage_options=s3_bucket.storage_options)
    assert torch.equal(distckpt.read(url, storage_options=s3_bucket.storage_options)["w"], sd["w"])
    assert not [k for k in s3_bucket.keys() if ".distckpt-probe-" in k]


def test_a_manager_save_into_a_missing_bucket_says_it_once(s3_bucket, caplog):
    """The manager's reclaim before a save logged "could not reclaim leftovers" with the very
    BucketNotFoundError the save then raised (an outside trial): the error is raised, not said
    twice."""
    opts = s3_bucket.storage_options
    mgr = distckpt.CheckpointManager("s3://no-such-bucket-distckpt/run", storage_options=opts)
    with caplog.at_level("WARNING", logger="distckpt"):
        with pytest.raises(errors.BucketNotFoundError):
            mgr.save(1, {"w": torch.ones(2)}, no_dist=True)
    assert "could not reclaim" not in caplog.text, caplog.text
