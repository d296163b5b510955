"""TieredCheckpointManager's fault handling in one process (no torchrun): the local tier a tmp
directory, the remote tier the suite's SeaweedFS server (sometimes through a proxy that refuses
credentials, or a private server that is killed or put over quota). Issue #25, item 5.

* credentials that stop working mid-run (every request answered 403 InvalidAccessKeyId for a
  while): the drain is ``retrying`` with ObjectStoreAccessError, saves go on locally, and once the
  credentials work again both steps drain, bit-exact, no multipart upload left;
* a bucket over quota (SeaweedFS s3.bucket.quota): the drain retries with a typed error, saves go
  on, lifting the quota lets it complete;
* wait_durable's timeout and close(timeout) while the server is down: NotDurableError naming the
  steps, the drain thread stopped; a new manager drains them at construction once it is back;
* a corrupted local data file: that step ``failed`` with ChecksumMismatchError (nothing visible
  remotely), the next step still drains;
* hostile arguments to the constructor and to save: ConfigError, nothing written on either tier;
* the drain channel's collective bound: DISTCKPT_DRAIN_TIMEOUT_S, not DISTCKPT_TIMEOUT_S
  (distckpt._dist.control_group(timeout_s=...)), on two gloo ranks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest
import torch

import distckpt
from distckpt import CheckpointManager
from distckpt.errors import (ChecksumMismatchError, ConfigError, EndpointUnreachableError, NotDurableError,
                             ObjectStoreAccessError, ObjectStoreError, PeerLostError)
from distckpt.tiers import TieredCheckpointManager
from tests.helpers import s3proxy
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.timeout(300)


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 18, generator=g), "b": torch.arange(7) * step, "step": step}


def _same(got: dict, step: int) -> bool:
    want = _state(step)
    return sorted(got) == sorted(want) and all(
        (torch.equal(got[k], v) and got[k].dtype == v.dtype) if isinstance(v, torch.Tensor) else got[k] == v
        for k, v in want.items())


def _wait_state(mgr, step: int, states: tuple[str, ...], timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while True:
        st = mgr.status(step)
        if st.remote in states:
            return st
        assert time.monotonic() < deadline, f"step {step} never reached {states}: {st}"
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def _short_requests(monkeypatch):
    # A request that cannot succeed gives up within seconds (the drains retry anyway).
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "3")
    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", "3")


# ---------------------------------------------------------------------------------------------
# A proxy that answers 403 while the credentials are "revoked"


class CredentialProxy(s3proxy.FaultProxy):
    """tests/helpers/s3proxy.FaultProxy, plus: while ``revoked`` is set, every request is answered
    ``403 InvalidAccessKeyId`` by the proxy (the server never sees it), as a server whose keys were
    rotated answers; ``denied`` counts those answers."""

    def __init__(self, upstream) -> None:
        self.revoked = threading.Event()
        self.denied = 0
        # What a "revoked" request is answered: (status, reason, S3 error code).
        self.answer = (403, "Forbidden", b"InvalidAccessKeyId")
        super().__init__(upstream)

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while not self._closed.is_set():
                try:
                    raw, start, _ = s3proxy._read_message(client, cbuf)
                except (EOFError, OSError, ValueError):
                    return
                method = start.split()[0]
                if self.revoked.is_set():
                    self.denied += 1
                    status, reason, code = self.answer
                    body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>' + code + b'</Code><Message>'
                            b'The access key ID you provided does not exist in our records.</Message></Error>')
                    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nx-amz-request-id: deny\r\n"
                            f"Content-Length: {0 if method == 'HEAD' else len(body)}\r\n\r\n").encode()
                    client.sendall(head + (b"" if method == "HEAD" else body))
                    continue
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    with self._lock:
                        self._socks.add(upstream)
                upstream.sendall(raw)
                while True:
                    resp, status_line, _ = s3proxy._read_message(upstream, ubuf, request_method=method)
                    if not 100 <= int(status_line.split()[1]) < 200:
                        break
                    client.sendall(resp)
                client.sendall(resp)
        except (EOFError, OSError):
            return
        finally:
            for s in (client, upstream):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass


@pytest.fixture
def cred_proxy(s3_server):
    u = urlsplit(s3_server.endpoint)
    px = CredentialProxy((u.hostname, u.port))
    yield px
    px.close()


def _tiers_through_a_proxy(s3_bucket, s3_server, tmp_path) -> tuple:
    """(a FaultProxy in front of the suite's server, the remote root URL, the local root, the
    storage options that reach the bucket through the proxy)."""
    u = urlsplit(s3_server.endpoint)
    px = s3proxy.FaultProxy((u.hostname, u.port))
    return px, f"{s3_bucket.url}/run", tmp_path / "local", _via(s3_bucket.storage_options, px.endpoint)


def _via(options: dict, endpoint: str) -> dict:
    return {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": endpoint},
            "skip_instance_cache": True}


def test_credentials_revoked_mid_run_retry_then_drain(s3_bucket, cred_proxy, tmp_path):
    url = f"{s3_bucket.url}/run"
    mgr = TieredCheckpointManager(tmp_path / "local", url, storage_options=_via(s3_bucket.storage_options,
                                                                                 cred_proxy.endpoint))
    try:
        cred_proxy.revoked.set()
        mgr.save(1, _state(1))
        st = _wait_state(mgr, 1, ("retrying",))
        assert isinstance(st.error, ObjectStoreAccessError), st
        assert st.local == "committed" and not st.durable and "credentials" in str(st.error), st
        mgr.save(2, _state(2))  # training goes on: the local save commits behind the stuck drain
        assert mgr.status(2).local == "committed" and mgr.status(2).remote == "queued"
        with pytest.raises(NotDurableError) as info:
            mgr.wait_durable(1, timeout=0.5)
        assert info.value.steps == [1] and isinstance(info.value.cause, ObjectStoreAccessError)
        time.sleep(2)  # a retry or two more, refused
        assert mgr.status(1).remote == "retrying" and mgr.status(1).tries >= 2
        assert cred_proxy.denied > 0
        cred_proxy.revoked.clear()  # the credentials work again (refreshed / rotated back)
        assert mgr.wait_durable(1, timeout=60).durable
        assert mgr.wait_durable(2, timeout=60).durable
    finally:
        cred_proxy.revoked.clear()
        mgr.close(timeout=60)
    opts = s3_bucket.storage_options
    assert CheckpointManager(url, storage_options=opts).steps() == [1, 2]
    for s in (1, 2):
        assert _same(distckpt.read(f"{url}/step_{s:08d}", storage_options=opts), s)
    assert s3_bucket.multipart_uploads() == []


# ---------------------------------------------------------------------------------------------
# The server down: wait_durable's timeout, close(timeout), the next manager drains


def test_wait_durable_and_close_time_out_while_the_server_is_down_then_a_new_manager_drains(
        s3_private_server, tmp_path):
    bucket, server = s3_private_server, s3_private_server.server
    url, opts, local = f"{bucket.url}/run", bucket.storage_options, tmp_path / "local"
    mgr = TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5)
    server.kill()  # connections refused from now on
    try:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))  # saves go on
        st = _wait_state(mgr, 1, ("retrying",))
        assert isinstance(st.error, EndpointUnreachableError), st
        t0 = time.monotonic()
        with pytest.raises(NotDurableError) as info:
            mgr.wait_durable(1, timeout=1.0)
        assert 0.9 <= time.monotonic() - t0 < 10 and info.value.steps == [1]
        assert isinstance(info.value.cause, EndpointUnreachableError)
        t0 = time.monotonic()
        with pytest.raises(NotDurableError) as info:
            mgr.close(timeout=1.0)
        assert time.monotonic() - t0 < 45, "close() did not stop the retries at its timeout"
        assert info.value.steps == [1, 2] and "1" in str(info.value) and "2" in str(info.value)
        assert not mgr._drainer.alive, "the drain thread outlived close()"
        assert {mgr.status(s).remote for s in (1, 2)} == {"stopped"}
        assert sorted(p.name for p in local.iterdir() if p.name.startswith("step_")) == ["step_00000001",
                                                                                          "step_00000002"]
    finally:
        server.restart()
    # The next manager (a restart) drains both at construction.
    with TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5) as again:
        assert again.wait_durable(1, timeout=60).durable and again.wait_durable(2, timeout=60).durable
    assert CheckpointManager(url, storage_options=opts).steps() == [1, 2]
    for s in (1, 2):
        assert _same(distckpt.read(f"{url}/step_{s:08d}", storage_options=opts), s)
    assert bucket.multipart_uploads() == []


# ---------------------------------------------------------------------------------------------
# A damaged local copy


def test_a_corrupted_local_file_fails_its_step_and_later_steps_still_drain(s3_bucket, cred_proxy, tmp_path):
    url, opts, local = f"{s3_bucket.url}/run", s3_bucket.storage_options, tmp_path / "local"
    mgr = TieredCheckpointManager(local, url, storage_options=_via(opts, cred_proxy.endpoint), keep_last_local=5)
    try:
        cred_proxy.revoked.set()  # hold the drains back (every try fails before it reads data)
        mgr.save(1, _state(1))
        data = local / "step_00000001" / "rank00000.bin"
        with open(data, "r+b") as f:  # one bit of the tensor's bytes, mid-block
            f.seek(100_000)
            b = f.read(1)
            f.seek(100_000)
            f.write(bytes([b[0] ^ 0x10]))
        mgr.save(2, _state(2))
        cred_proxy.revoked.clear()
        st = _wait_state(mgr, 1, ("failed", "committed"))
        assert st.remote == "failed" and isinstance(st.error, ChecksumMismatchError), st
        assert "rank00000.bin" in str(st.error)
        with pytest.raises(NotDurableError) as info:
            mgr.wait_durable(1, timeout=5)
        assert isinstance(info.value.cause, ChecksumMismatchError)
        assert mgr.wait_durable(2, timeout=60).durable  # the queue moved on
    finally:
        cred_proxy.revoked.clear()
        with pytest.raises(NotDurableError) as info:
            mgr.close(timeout=60)
    assert info.value.steps == [1]
    assert CheckpointManager(url, storage_options=opts).steps() == [2]
    assert not [k for k in s3_bucket.keys("run") if k.startswith("run/step_00000001/")], s3_bucket.keys("run")
    assert _same(distckpt.read(f"{url}/step_00000002", storage_options=opts), 2)
    assert s3_bucket.multipart_uploads() == []


# ---------------------------------------------------------------------------------------------
# Hostile arguments


@pytest.mark.parametrize("kwargs", [
    {"keep_last_local": 0}, {"keep_last_local": -1}, {"keep_last_local": True}, {"keep_last_local": 1.5},
    {"keep_last_local": "2"}, {"keep_last_remote": 0}, {"local": "s3://{bucket}/local"},
    {"local": "{remote}"}, {"drain_timeout_s": -1}, {"drain_timeout_s": "soon"}, {"drain_timeout_s": float("nan")},
], ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_hostile_constructor_arguments_are_config_errors_and_write_nothing(s3_bucket, tmp_path, kwargs):
    remote = f"{s3_bucket.url}/run"
    args = {"local": str(tmp_path / "local"), "remote": remote, "storage_options": s3_bucket.storage_options}
    for k, v in kwargs.items():
        args[k] = v.format(bucket=s3_bucket.name, remote=remote) if isinstance(v, str) and "{" in v else v
    with pytest.raises(ConfigError):
        TieredCheckpointManager(args.pop("local"), args.pop("remote"), **args)
    assert not (tmp_path / "local").exists()
    assert s3_bucket.keys() == []


def test_remote_equal_to_a_local_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError):
        TieredCheckpointManager(tmp_path / "same", str(tmp_path / "same") + "/")
    assert not (tmp_path / "same").exists()


def test_hostile_save_arguments_are_config_errors_and_write_nothing(s3_bucket, tmp_path):
    local = tmp_path / "local"
    with TieredCheckpointManager(local, f"{s3_bucket.url}/run", storage_options=s3_bucket.storage_options) as mgr:
        for step, kw in ((-1, {}), (True, {}), ("3", {}), (1.0, {}), (None, {}), (1, {"incremental": True}),
                         (1, {"incremental": {"base": 0}}), (1, {"storage_options": {}}), (1, {"process_group": None})):
            with pytest.raises(ConfigError):
                mgr.save(step, _state(1), **kw)
        assert not [p for p in local.iterdir() if p.name.startswith(("step_", ".tmp"))], list(local.iterdir())
        # The remote tier's identity, written when the manager was built, and its owner's lease.
        paired = s3_bucket.keys()
        assert [k.rpartition("/")[2] for k in paired] == [".distckpt-tier", ".distckpt-tiers.owner"], paired
    with pytest.raises(ConfigError):
        mgr.save(1, _state(1))  # closed
    assert s3_bucket.keys() == ["run/.distckpt-tier"]  # the owner's lease released at close


# ---------------------------------------------------------------------------------------------
# A bucket over quota (SeaweedFS): a typed error, retried; lifting the quota lets it complete


def _enforce(server, want: str, deadline: float) -> None:
    import subprocess
    while True:
        try:
            if want in server.shell("s3.bucket.quota.enforce -apply", timeout_s=30):
                return
        except subprocess.TimeoutExpired:
            pass
        assert time.monotonic() < deadline, f"SeaweedFS never said {want!r}: {server.log_path.read_text()[-3000:]}"
        time.sleep(1)


@pytest.mark.slow  # SeaweedFS notices a quota in its own time (tens of seconds)
@pytest.mark.timeout(600)
def test_a_bucket_over_quota_retries_typed_then_drains_when_lifted(s3_private_server, tmp_path):
    bucket, server = s3_private_server, s3_private_server.server
    url, opts, b = f"{bucket.url}/run", bucket.storage_options, bucket.name
    mgr = TieredCheckpointManager(tmp_path / "local", url, storage_options=opts, keep_last_local=5)
    try:
        server.shell(f"s3.bucket.quota -name {b} -op set -sizeMB 1")
        bucket.fs.pipe(f"{b}/filler", os.urandom(3 << 20))
        _enforce(server, "read only", time.monotonic() + 300)
        mgr.save(1, _state(1))
        st = _wait_state(mgr, 1, ("retrying",), timeout=120)
        # SeaweedFS answers a write over quota with 500 InternalError (tests/s3/test_s3_infra.py::
        # test_quota): an ObjectStoreError (QuotaExceededError where the store says so).
        assert isinstance(st.error, ObjectStoreError), st
        mgr.save(2, _state(2))  # training goes on
        assert mgr.status(2).local == "committed"
        bucket.fs.rm(f"{b}/filler")
        server.shell(f"s3.bucket.quota -name {b} -op remove")
        _enforce(server, "", time.monotonic() + 300)
        assert mgr.wait_durable(1, timeout=240).durable and mgr.wait_durable(2, timeout=120).durable
    finally:
        mgr.close(timeout=30)
    assert CheckpointManager(url, storage_options=opts).steps() == [1, 2]
    assert _same(distckpt.read(f"{url}/step_00000002", storage_options=opts), 2)


# ---------------------------------------------------------------------------------------------
# The drain channel's collective bound (2 gloo ranks, no server)


def _late(group, rank: int) -> tuple[str, float]:
    """An all_gather that rank 1 joins 4 s late: ("ok" or "lost", rank's wait)."""
    group.all_gather(0)  # both ranks there
    if rank == 1:
        time.sleep(4)
    t0 = time.monotonic()
    try:
        group.all_gather(rank)
        return "ok", time.monotonic() - t0
    except PeerLostError:
        return "lost", time.monotonic() - t0


def _slow_peer(rank, world, remote, local_base):
    from distckpt._dist import control_group
    out = {}
    # A channel with its own bound outlasts a peer 4 s late.
    out["long"] = _late(control_group(channel="long", timeout_s=30.0), rank)
    # The manager's drain channel takes DISTCKPT_DRAIN_TIMEOUT_S (10 s here).
    with TieredCheckpointManager(f"{local_base}-{rank}", remote, keep_last_local=1) as mgr:
        out["drain"] = _late(mgr._drain_group, rank)
    # The default bound, DISTCKPT_TIMEOUT_S (2 s here), does not (the last: the group is broken after).
    out["short"] = _late(control_group(channel="short"), rank)
    return out


def test_the_drain_channel_is_bounded_by_DISTCKPT_DRAIN_TIMEOUT_S(tmp_path):
    env = {"DISTCKPT_TIMEOUT_S": "2", "DISTCKPT_DRAIN_TIMEOUT_S": "10", "DISTCKPT_ARRIVAL_TIMEOUT_S": "0"}
    res = run_ranks(_slow_peer, 2, str(tmp_path / "remote"), str(tmp_path / "local"), env=env, timeout=120)
    assert res[0]["long"][0] == "ok" and res[0]["long"][1] > 3, res
    assert res[0]["drain"][0] == "ok" and res[0]["drain"][1] > 3, res
    assert res[0]["short"][0] == "lost" and res[0]["short"][1] < 4, res


# ---------------------------------------------------------------------------------------------
# What the drainer retries (no server)


def test_is_retryable_classifies_the_drain_errors():
    from distckpt import errors as e
    from distckpt.tiers.drainer import is_retryable
    retried = [e.ObjectStoreAccessError("expired", code="ExpiredToken"), e.QuotaExceededError("full"),
               e.ObjectStoreError("500 InternalError"), e.EndpointUnreachableError("down"), e.ThrottledError("slow"),
               e.BucketNotFoundError("gone"), e.SaveInProgressError("lease held"), OSError(5, "EIO")]
    final = [e.ChecksumMismatchError("flip"), e.TierIncompleteError("wiped"), e.CheckpointExistsError("other save"),
             e.ManifestCorruptError("bad"), e.ConfigError("bad"), e.PeerLostError("gone"), ValueError("bug")]
    assert [type(x).__name__ for x in retried if not is_retryable(x)] == []
    assert [type(x).__name__ for x in final if is_retryable(x)] == []


# ---------------------------------------------------------------------------------------------
# A remote tier that is dark (every request held unanswered) when a manager starts


def test_a_manager_started_on_a_dark_remote_waits_one_request_deadline_then_drains_when_it_answers(
        s3_bucket, s3_server, tmp_path):
    """The pre-flight finds the remote tier dark: construction warns and goes on after one request
    deadline (it used to list the remote tier as well, a second deadline), queues every local step
    not known to be remote, and drains them once the remote tier answers. close() on a dark remote
    says the steps are *not known* to be there (a held request may still land)."""
    u = urlsplit(s3_server.endpoint)
    px = s3proxy.FaultProxy((u.hostname, u.port))
    url, local = f"{s3_bucket.url}/run", tmp_path / "local"
    opts = _via(s3_bucket.storage_options, px.endpoint)
    deadline = float(os.environ["DISTCKPT_OBJECT_REQUEST_TIMEOUT_S"])
    try:
        px.rule = lambda n, method, path: "stall"
        mgr = TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5)
        mgr.save(1, _state(1))
        with pytest.raises(NotDurableError, match="not known to be on the remote tier") as info:
            mgr.close(timeout=1.0)
        assert info.value.steps == [1]
        px.reset_log()
        t0 = time.monotonic()
        again = TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5)
        took = time.monotonic() - t0
        assert took < 1.8 * deadline, f"construction on a dark remote took {took:.1f} s (request deadline {deadline} s)"
        assert again.status(1).remote in ("queued", "draining", "retrying"), again.status(1)
        px.rule = lambda n, method, path: None  # the remote tier answers again
        assert again.wait_durable(1, timeout=60).durable
        again.close(timeout=60)
    finally:
        px.rule = lambda n, method, path: None
        px.close()
    assert _same(distckpt.read(f"{url}/step_{1:08d}", storage_options=s3_bucket.storage_options), 1)
    assert s3_bucket.multipart_uploads() == []


def test_a_restart_on_a_dark_remote_does_not_drain_again_what_keep_last_remote_rotated_away(s3_bucket, s3_server,
                                                                                         tmp_path):
    """keep_last_local=5 > keep_last_remote=2, and the remote tier dark while the restarted manager
    is built: it queues every complete local step (it cannot list the remote tier), and once the
    remote tier answered, steps 10, 20 and 30 (rotated away there long ago) were uploaded again and
    the remote `latest` pointed back at 30 (an outside trial). The first drain now lists the remote
    tier and skips what its rotation would delete at once; `latest` stays at 50."""
    u = urlsplit(s3_server.endpoint)
    px = s3proxy.FaultProxy((u.hostname, u.port))
    url, local = f"{s3_bucket.url}/run", tmp_path / "local"
    opts = _via(s3_bucket.storage_options, px.endpoint)
    try:
        with TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5, keep_last_remote=2) as mgr:
            for s in (10, 20, 30, 40, 50):
                mgr.save(s, _state(s))
                assert mgr.wait_durable(s, timeout=60).durable
        px.rule = lambda n, method, path: "stall"
        again = TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5, keep_last_remote=2)
        px.rule = lambda n, method, path: None  # the remote tier answers again
        px.reset_log()
        again.close(timeout=60)
        sent = [p for _, m, p in px.log if m == "PUT" and "step_000000" in p]
        assert not any(f"step_000000{s}" in p for p in sent for s in (10, 20, 30)), sent
    finally:
        px.rule = lambda n, method, path: None
        px.close()
    steps = sorted({k.split("/")[1] for k in s3_bucket.keys("run") if k.startswith("run/step_")})
    assert steps == ["step_00000040", "step_00000050"], steps
    assert s3_bucket.fs.cat_file(f"{s3_bucket.name}/run/latest") == b"step_00000050\n"


def test_a_restore_only_job_on_a_dark_remote_does_not_report_steps_an_earlier_job_drained(s3_bucket, s3_server,
                                                                                          tmp_path):
    """A job that only loads, started while the remote tier does not answer: its close() raised
    NotDurableError naming steps an earlier job had drained (it cannot list the remote tier, so
    it queued every complete local step). Each node's local tier now records the saves it saw
    reach the remote tier (distckpt.tiers.records): those are not queued again; a step the
    earlier job never drained still is, and close names it alone. A record for another tier
    (the tiers paired anew) spares nothing."""
    px, url, local, opts = _tiers_through_a_proxy(s3_bucket, s3_server, tmp_path)
    try:
        with TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5) as mgr:
            for s in (1, 2):
                mgr.save(s, _state(s))
                assert mgr.wait_durable(s, timeout=60).durable
        record = (local / ".distckpt-tier-drained").read_text().split("\n")
        assert [line.split()[0] for line in record[2:] if line] == ["1", "2"], record
        px.rule = lambda n, method, path: "stall"
        mgr = TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5)
        got = _state(0)
        res = mgr.load(got)
        assert _same(got, 2) and res.remote_unchecked, res
        mgr.close(timeout=1.0)  # nothing to drain: both steps reached the remote tier before

        # `distckpt ls LOCAL --remote URL` on the dark remote tier shows the local tier (it printed
        # nothing but the error), each step's remote column from the record, and exits 1.
        env = {**os.environ, **s3_bucket.env, "AWS_ENDPOINT_URL": px.endpoint,
               "DISTCKPT_OBJECT_REQUEST_TIMEOUT_S": "1"}
        ls = subprocess.run([sys.executable, "-m", "distckpt", "ls", str(local), "--remote", url], env=env,
                            capture_output=True, text=True, timeout=120)
        assert ls.returncode == 3 and "could not be listed" in ls.stderr, (ls.returncode, ls.stderr)
        rows = {line.split()[0]: line for line in ls.stdout.splitlines()[2:]}
        assert sorted(rows) == ["1", "2"] and all("unknown (recorded drained)" in r for r in rows.values()), ls.stdout
        ls = subprocess.run([sys.executable, "-m", "distckpt", "ls", str(local), "--remote", url, "--json"], env=env,
                            capture_output=True, text=True, timeout=120)
        doc = json.loads(ls.stdout)
        assert ls.returncode == 3 and doc["remote_error"]["type"] == "EndpointUnreachableError", ls.stdout
        assert [(r["step"], r["remote"], r["drained"]) for r in doc["steps"]] == [(1, "unknown", True),
                                                                                  (2, "unknown", True)]
        # The record is of the remote root the steps were drained to: another root (empty, also
        # dark) is told nothing by it, and a manager built on it spares no step.
        other = f"{s3_bucket.url}/elsewhere"
        ls = subprocess.run([sys.executable, "-m", "distckpt", "ls", str(local), "--remote", other, "--json"],
                            env=env, capture_output=True, text=True, timeout=120)
        assert ls.returncode == 3 and [r["drained"] for r in json.loads(ls.stdout)["steps"]] == [False, False]
        elsewhere = TieredCheckpointManager(local, other, storage_options=opts, keep_last_local=5)
        with pytest.raises(NotDurableError) as info:
            elsewhere.close(timeout=1.0)
        assert info.value.steps == [1, 2]

        # A step saved while the remote tier is dark is not in any record: the next dark start
        # queues it, and its close names it alone.
        mgr = TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5)
        mgr.save(3, _state(3))
        with pytest.raises(NotDurableError) as info:
            mgr.close(timeout=1.0)
        assert info.value.steps == [3]
        again = TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5)
        assert again.status(3).remote in ("queued", "draining", "retrying")
        with pytest.raises(NotDurableError) as info:
            again.close(timeout=1.0)
        assert info.value.steps == [3]

        # A record of another tier spares nothing.
        lines = (local / ".distckpt-tier-drained").read_text().split("\n")
        (local / ".distckpt-tier-drained").write_text("\n".join(["0" * 32] + lines[1:]))
        again = TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5)
        with pytest.raises(NotDurableError) as info:
            again.close(timeout=1.0)
        assert info.value.steps == [1, 2, 3]

        px.rule = lambda n, method, path: None  # the remote tier answers: every step drains, or is there
        with TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5) as mgr:
            assert mgr.wait_durable(3, timeout=60).durable
        record = (local / ".distckpt-tier-drained").read_text().split("\n")
        assert "3" in [line.split()[0] for line in record[2:] if line], record
    finally:
        px.rule = lambda n, method, path: None
        px.close()
    for s in (1, 2, 3):
        assert _same(distckpt.read(f"{url}/step_{s:08d}", storage_options=s3_bucket.storage_options), s)


def test_a_remote_answering_5xx_at_construction_is_an_outage_not_an_error(s3_bucket, cred_proxy, tmp_path,
                                                                          monkeypatch, caplog):
    """A server error (HTTP 500 to every request) at the pre-flight warns, as the docstring says of
    an outage: saves go on locally, and the step drains once the server answers again. (With a
    request deadline shorter than botocore's retries of the 500s, it surfaced as
    EndpointUnreachableError, which hid that the 500 itself was raised.)"""
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "30")
    url = f"{s3_bucket.url}/run"
    cred_proxy.answer = (500, "Internal Server Error", b"InternalError")
    cred_proxy.revoked.set()
    caplog.set_level("WARNING", logger="distckpt")
    mgr = TieredCheckpointManager(tmp_path / "local", url, storage_options=_via(s3_bucket.storage_options,
                                                                                 cred_proxy.endpoint))
    try:
        assert any("does not answer" in r.getMessage() for r in caplog.records)
        mgr.save(1, _state(1))
        assert mgr.status(1).local == "committed"
        cred_proxy.revoked.clear()
        assert mgr.wait_durable(1, timeout=90).durable
    finally:
        cred_proxy.revoked.clear()
        mgr.close(timeout=60)
    assert _same(distckpt.read(f"{url}/step_{1:08d}", storage_options=s3_bucket.storage_options), 1)


def test_a_remote_down_at_construction_is_paired_before_the_first_drain(s3_bucket, cred_proxy, tmp_path,
                                                                       monkeypatch):
    """The tiers' pairing (TierMismatchError: a remote root that is not the tier this node's local
    tier drained to) was checked only at construction when the remote tier answered: a manager
    built while it was down drained, once it answered, into whatever the root now was, and
    reported the steps durable there. Here the local tier drained to ``run``; a manager built on
    ``other`` (another job's prefix, a mistyped one, an endpoint now serving another bucket)
    while the server answers 500 must not drain into it, nor load from it, when it answers again."""
    from distckpt.errors import TierMismatchError
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "30")
    local = tmp_path / "local"
    opts = _via(s3_bucket.storage_options, cred_proxy.endpoint)
    with TieredCheckpointManager(local, f"{s3_bucket.url}/run", storage_options=opts) as mgr:
        mgr.save(1, _state(1))
        assert mgr.wait_durable(1, timeout=90).durable
    other = f"{s3_bucket.url}/other"
    cred_proxy.answer = (500, "Internal Server Error", b"InternalError")
    cred_proxy.revoked.set()
    mgr = TieredCheckpointManager(local, other, storage_options=opts)
    try:
        mgr.save(2, _state(2))
        assert mgr.status(2).local == "committed"
        cred_proxy.revoked.clear()
        # A load is checked too: the remote root is no tier this node drained to (a review found
        # a load read another job's steps from it as the reference tier).
        with pytest.raises(TierMismatchError):
            mgr.load({"w": torch.zeros(1 << 18), "b": torch.zeros(7, dtype=torch.int64), "step": 0})
        with pytest.raises(NotDurableError) as info:
            mgr.wait_durable(2, timeout=90)
        assert isinstance(info.value.cause, TierMismatchError), repr(info.value)
        assert mgr.status(2).remote == "failed" and mgr.status(2).local == "committed"
    finally:
        cred_proxy.revoked.clear()
        with contextlib.suppress(NotDurableError):
            mgr.close(timeout=60)
    assert s3_bucket.keys("other/") == [], "nothing may be drained into a remote root that is not this tier's"
    # The tier it was paired with still takes its drains.
    with TieredCheckpointManager(local, f"{s3_bucket.url}/run", storage_options=opts) as mgr:
        assert mgr.wait_durable(2, timeout=90).durable


@contextlib.contextmanager
def _step_one_drained_through_a_proxy(s3_bucket, s3_server, tmp_path):
    """(manager, proxy, its drained status of step 1, remote URL): a manager whose remote tier is
    reached through a FaultProxy, step 1 saved and durable; the proxy is cleared and the manager
    closed afterwards."""
    u = urlsplit(s3_server.endpoint)
    px = s3proxy.FaultProxy((u.hostname, u.port))
    url = f"{s3_bucket.url}/run"
    try:
        mgr = TieredCheckpointManager(tmp_path / "local", url, storage_options=_via(s3_bucket.storage_options,
                                                                                     px.endpoint))
        try:
            mgr.save(1, _state(1))
            drained = mgr.wait_durable(1, timeout=60)
            assert drained.durable
            yield mgr, px, drained, url
        finally:
            px.rule = lambda n, method, path: None
            mgr.close(timeout=30)
    finally:
        px.rule = lambda n, method, path: None
        px.close()


def test_a_step_this_manager_drained_is_durable_without_a_request_once_the_remote_goes_dark(
        s3_bucket, s3_server, tmp_path):
    """status(step) and wait_durable(step) of a step this manager drained answer from what it knows
    (it committed that save there): no request, so a remote tier that goes dark afterwards (every
    request held unanswered) neither slows them nor makes them raise EndpointUnreachableError, as
    they did when they asked the remote tier again."""
    with _step_one_drained_through_a_proxy(s3_bucket, s3_server, tmp_path) as (mgr, px, drained, url):
        px.rule = lambda n, method, path: "stall"  # the remote tier goes dark
        px.reset_log()
        t0 = time.monotonic()
        st = mgr.status(1)
        again = mgr.wait_durable(1, timeout=30)
        took = time.monotonic() - t0
        assert st.durable and again.durable and st.save_id == drained.save_id, (st, again)
        assert took < 1.0, f"status/wait_durable of a drained step took {took:.1f} s"
        assert px.log == [], f"requests sent for a step this manager drained: {px.log}"
        px.rule = lambda n, method, path: None
    assert _same(distckpt.read(f"{url}/step_{1:08d}", storage_options=s3_bucket.storage_options), 1)


def test_a_dark_remote_loads_the_local_copy_for_a_given_step_too_and_says_it_was_not_checked(
        s3_bucket, s3_server, tmp_path, caplog):
    """With the remote tier dark and the local copy complete, load() restored the step from the
    local tier but load(step=N) raised EndpointUnreachableError (an outside trial); and neither
    said that the local copy could not be checked against the remote tier, the reference when it
    answers (a stale local copy of another save of the step would be loaded silently). Both load
    the local copy now, and the result's remote_unchecked says why."""
    caplog.set_level("WARNING", logger="distckpt")
    with _step_one_drained_through_a_proxy(s3_bucket, s3_server, tmp_path) as (mgr, px, _drained, _url):
        px.rule = lambda n, method, path: "stall"  # the remote tier goes dark
        for step in (1, None):
            got = _state(0)
            res = mgr.load(got, step=step)
            assert _same(got, 1), step
            assert res.remote_unchecked and "EndpointUnreachableError" in res.remote_unchecked, (step, res)
            assert res.bytes_by_tier.get("remote", 0) == 0, res.bytes_by_tier
        assert any("cannot be checked against it" in r.getMessage() for r in caplog.records)
        px.rule = lambda n, method, path: None
        res = mgr.load(_state(0), step=1)
        assert res.remote_unchecked is None, res


def _stall_after_listing(mgr, key: str):
    """A proxy rule that stalls every request for ``key`` once ``mgr`` has listed the tiers (its
    load's listing returned), so the remote tier answers the listing and goes dark before the
    load reads the step; and the list of requests it stalled. (Counting requests instead was
    fragile: on a busy machine a listing's request outlived its deadline, and its retry counted.)"""
    dark = threading.Event()
    stalled: list = []
    listed = mgr._candidates

    def candidates(*args, **kwargs):
        out = listed(*args, **kwargs)
        dark.set()
        return out

    mgr._candidates = candidates

    def rule(n, method, path):
        if dark.is_set() and key in path:
            stalled.append(method)
            return "stall"
        return None
    return rule, stalled


def test_load_falls_back_to_the_local_copy_when_the_remote_goes_dark_after_its_listing(
        s3_bucket, s3_server, tmp_path, monkeypatch):
    """load() lists the steps (the remote tier answers), then the remote tier goes dark before
    the load reads the step's MANIFEST: it raised EndpointUnreachableError although this node
    holds the step complete (load(step=N) fell back already). It restores the local copy now,
    saying it was not checked."""
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "2")
    with _step_one_drained_through_a_proxy(s3_bucket, s3_server, tmp_path) as (mgr, px, _drained, _url):
        px.rule, stalled = _stall_after_listing(mgr, "step_00000001/MANIFEST")
        got = _state(0)
        res = mgr.load(got)
        assert _same(got, 1) and stalled, stalled
        assert res.remote_unchecked and "EndpointUnreachableError" in res.remote_unchecked, res


def test_a_stale_local_copy_the_listing_saw_is_passed_over_when_the_remote_goes_dark_after_it(
        s3_bucket, s3_server, tmp_path, monkeypatch, caplog):
    """The listing finds the remote tier holding steps 2 and 3 as one save each and this node's
    disk holding other saves of them (a stale disk); the remote tier then goes dark before the
    load reads step 3. Falling back to the local copy loaded the stale save with only
    remote_unchecked set, though the listing had shown it is not the step the tiers know (and
    once step 3 was passed over, step 2's stale copy was loaded the same way): both are passed
    over by name and step 1 (the same save on both tiers) loads."""
    import shutil

    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "2")
    px, url, local, opts = _tiers_through_a_proxy(s3_bucket, s3_server, tmp_path)
    try:
        with TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5) as mgr:
            for s in (1, 2, 3):
                mgr.save(s, _state(s))
                assert mgr.wait_durable(s, timeout=60).durable
        for s in (2, 3):  # other saves of steps 2 and 3 on this disk
            shutil.rmtree(local / f"step_{s:08d}")
            distckpt.save(_state(100 + s), local / f"step_{s:08d}")
        mgr = TieredCheckpointManager(local, url, storage_options=opts, keep_last_local=5)
        try:
            px.rule, stalled = _stall_after_listing(mgr, "step_00000003/MANIFEST")
            got = _state(0)
            with caplog.at_level(logging.WARNING, logger="distckpt"):
                res = mgr.load(got)
            assert stalled, stalled
            assert "step 3 has no complete copy" in caplog.text and "step 2 has no complete copy" in caplog.text
            assert "another save" in caplog.text
            assert _same(got, 1), got["step"]
            assert res.remote_unchecked and "EndpointUnreachableError" in res.remote_unchecked, res
        finally:
            px.rule = lambda n, method, path: None
            mgr.close(timeout=30)
    finally:
        px.close()


@pytest.mark.parametrize("dark", ["every-request", "the-data-after-the-listing"])
def test_no_complete_local_copy_and_a_dark_remote_is_the_remotes_error_not_no_checkpoint(
        s3_bucket, s3_server, tmp_path, monkeypatch, dark):
    """The node's local copy is gone (a replaced node, replicas off) and the remote tier, which
    holds the step, does not answer: every request, or only the GET of the step's data file once
    the listing answered. load() raised CheckpointNotFoundError, a FileNotFoundError ("no step with
    a complete copy"), which a resume loop reads as an empty run and starts from scratch (an
    outside trial); latest_step() returned None. Both raise the remote tier's own typed error
    now, noted, and load the step once the remote tier answers again."""
    import shutil

    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "2")
    with _step_one_drained_through_a_proxy(s3_bucket, s3_server, tmp_path) as (mgr, px, _drained, _url):
        shutil.rmtree(tmp_path / "local" / "step_00000001")
        if dark == "every-request":
            px.rule = lambda n, method, path: "stall"
            with pytest.raises(EndpointUnreachableError) as info:
                mgr.latest_step()
            assert not isinstance(info.value, FileNotFoundError)
        else:
            px.rule, stalled = _stall_after_listing(mgr, "rank00000.bin")
        with pytest.raises(EndpointUnreachableError) as info:
            mgr.load(_state(0))
        assert not isinstance(info.value, FileNotFoundError)
        assert "this is not an empty checkpoint root" in "\n".join(getattr(info.value, "__notes__", [])), info.value
        if dark != "every-request":
            assert stalled, stalled
        px.rule = lambda n, method, path: None
        got = _state(0)
        mgr.load(got)
        assert _same(got, 1)


def test_a_step_passed_over_while_the_remote_is_dark_is_not_said_to_be_missing_there(
        s3_bucket, s3_server, tmp_path, monkeypatch, caplog):
    """An outside trial: with the remote tier dark, the warning passing over a step whose local
    copy lacks a file said "the remote tier has not committed it", though the remote tier held
    it and only did not answer: an operator reads a lost step. It says the remote tier, which did
    not answer, is not known to hold it now."""
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "2")
    with _step_one_drained_through_a_proxy(s3_bucket, s3_server, tmp_path) as (mgr, px, _drained, _url):
        os.unlink(tmp_path / "local" / "step_00000001" / "rank00000.bin")
        px.rule = lambda n, method, path: "stall"
        with caplog.at_level("WARNING", logger="distckpt"):
            with pytest.raises(EndpointUnreachableError):
                mgr.latest_step()
        said = [r.getMessage() for r in caplog.records if "step 1 " in r.getMessage()]
        assert any("did not answer, is not known to hold it" in m and "rank00000.bin" in m for m in said), said
        assert not any("has not committed it" in m for m in said), said
        px.rule = lambda n, method, path: None
        got = _state(0)
        mgr.load(got)
        assert _same(got, 1)


# ---------------------------------------------------------------------------------------------
# close(timeout) while a request of the drain is held unanswered


_CLOSE_WHILE_HELD = r"""
import json, os, sys, time
from distckpt.errors import NotDurableError
from distckpt.tiers import TieredCheckpointManager
from tests.s3.test_tiers_faults import _state
mgr = TieredCheckpointManager(sys.argv[1], sys.argv[2], storage_options=json.loads(sys.argv[3]))
mgr.save(1, _state(1))
print("saved", flush=True)
sys.stdin.readline()  # the test stalls the remote tier, then says go
deadline = time.monotonic() + 60
while mgr.status(1).remote != "draining":
    assert time.monotonic() < deadline
    time.sleep(0.05)
time.sleep(0.5)  # the drain's request is held by now
t0 = time.monotonic()
try:
    mgr.close(timeout=1.0)
    print(json.dumps({"raised": None}), flush=True)
except NotDurableError as exc:
    print(json.dumps({"raised": type(exc).__name__, "steps": exc.steps, "took": time.monotonic() - t0,
                      "alive": mgr._drainer.alive, "state": mgr.status(1).remote}), flush=True)
"""


def test_close_returns_within_its_timeout_while_a_drain_request_is_held(s3_bucket, s3_server, tmp_path):
    """close(timeout) while the drain's request is held by a stalled server (a proxy that never
    answers) returns within its timeout plus a small slack, raising NotDurableError for the step
    (not known to be remote), and the process exits at once after it. It used to join the drain
    thread for up to 35 s more: as long as the held request's deadline
    (DISTCKPT_OBJECT_REQUEST_TIMEOUT_S, 20 s here). The abandoned drain never reports the step
    durable, and a new manager drains it once the remote tier answers."""
    import json
    import subprocess
    import sys
    u = urlsplit(s3_server.endpoint)
    px = s3proxy.FaultProxy((u.hostname, u.port))
    url, local = f"{s3_bucket.url}/run", tmp_path / "local"
    opts = _via(s3_bucket.storage_options, px.endpoint)
    env = {**os.environ, "DISTCKPT_OBJECT_REQUEST_TIMEOUT_S": "20", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", _CLOSE_WHILE_HELD, str(local), url, json.dumps(opts)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=os.getcwd())
    try:
        assert proc.stdout.readline().strip() == "saved"
        px.rule = lambda n, method, path: "stall"  # every request from now on is held unanswered
        t0 = time.monotonic()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        said = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=60) == 0
        lived = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        px.rule = lambda n, method, path: None
    try:
        assert said["raised"] == "NotDurableError" and said["steps"] == [1], said
        from distckpt.tiers.drainer import _CLOSE_GRACE_S
        assert said["took"] < 1.0 + _CLOSE_GRACE_S + 2, f"close(timeout=1.0) took {said['took']:.1f} s with a request held"
        assert said["state"] != "committed", said  # never reported durable: it is not
        # Nothing held the exit either (the held request's deadline is 20 s).
        assert lived < 15, f"the process lived {lived:.1f} s after the drain's request was held"
        # The step stayed committed locally; the next manager drains it.
        with TieredCheckpointManager(local, url, storage_options=opts) as again:
            assert again.wait_durable(1, timeout=60).durable
    finally:
        px.close()
    assert _same(distckpt.read(f"{url}/step_{1:08d}", storage_options=s3_bucket.storage_options), 1)


def _close_while_held(rank, world, local_base, url, opts, flag):
    import torch.distributed as dist
    out = {}
    mgr = TieredCheckpointManager(f"{local_base}-{rank}", url, storage_options=opts)
    if rank == 0:
        open(flag, "w").close()  # the proxy holds every request from now on
    dist.barrier()
    mgr.save(1, _state(1))
    deadline = time.monotonic() + 60
    while mgr.status(1).remote != "draining":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0's first request of the drain is held by now; rank 1 waits for it
    t0 = time.monotonic()
    try:
        mgr.close(timeout=1.0)
        out["raised"] = None
    except NotDurableError as exc:
        out.update(raised=type(exc).__name__, steps=exc.steps)
    out.update(took=time.monotonic() - t0, state=mgr.status(1).remote)
    out["end"] = time.time()  # then run_ranks destroys the process group and the rank exits
    return out


def test_close_on_two_ranks_returns_within_its_timeout_while_a_drain_request_is_held(s3_bucket, s3_server,
                                                                                      tmp_path):
    """The same on two gloo ranks: rank 0's drain request is held, rank 1's drain thread waits for
    it in the drain's collective. close(timeout) returns on both within the timeout plus a small
    slack, and neither the held request (deadline 60 s) nor the collective in flight
    (DISTCKPT_DRAIN_TIMEOUT_S) holds the ranks' exit (run_ranks destroys the process group first)."""
    u = urlsplit(s3_server.endpoint)
    px = s3proxy.FaultProxy((u.hostname, u.port))
    flag = tmp_path / "dark"
    url = f"{s3_bucket.url}/run"
    opts = _via(s3_bucket.storage_options, px.endpoint)
    px.rule = lambda n, method, path: "stall" if flag.exists() else None
    env = {"DISTCKPT_OBJECT_REQUEST_TIMEOUT_S": "60", "DISTCKPT_DRAIN_TIMEOUT_S": "300"}
    try:
        res = run_ranks(_close_while_held, 2, str(tmp_path / "local"), url, opts, str(flag), env=env, timeout=240)
        exited = time.time()
    finally:
        px.rule = lambda n, method, path: None
        px.close()
    from distckpt.tiers.drainer import _CLOSE_GRACE_S
    for r in res:
        assert r["raised"] == "NotDurableError" and r["steps"] == [1], res
        assert r["took"] < 1.0 + _CLOSE_GRACE_S + 2, res
        assert r["state"] != "committed", res
    assert exited - max(r["end"] for r in res) < 30, f"the ranks exited {exited - max(r['end'] for r in res):.1f} s " \
                                                     f"after close returned"


def test_a_drain_retry_after_a_lost_answer_is_never_undone_by_a_late_request(s3_bucket, s3_server, tmp_path,
                                                                             monkeypatch):
    """The first PUT of a step's data object is applied by the server but its answer never comes;
    the drain's next try uploads the same key and commits. Any request the failed try sent after
    it (it used to DELETE the object it could not confirm) is held by the network and lands after
    the commit: the committed step must stay whole, and the local copy that rotation deletes once
    the remote tier holds the step must not have been the last one."""
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "2")
    u = urlsplit(s3_server.endpoint)
    px = s3proxy.FaultProxy((u.hostname, u.port))
    seen = {"lost": 0, "held": []}

    def rule(n, method, path):
        if "step_00000001" in path and "rank00000.bin" in path:
            if method == "PUT" and not seen["lost"]:
                seen["lost"] += 1
                return "act_then_stall"
            if seen["lost"] and method in ("DELETE", "POST", "PUT") and not seen["held"]:
                seen["held"].append(method)  # the failed try's own follow-up, if any: landing late
                return ("delay", 6)
        return None

    px.rule = rule
    url = f"{s3_bucket.url}/run"
    opts = _via(s3_bucket.storage_options, px.endpoint)
    try:
        mgr = TieredCheckpointManager(tmp_path / "local", url, storage_options=opts, keep_last_local=1)
        mgr.save(1, _state(1))
        assert mgr.wait_durable(1, timeout=90).durable
        assert seen["lost"] == 1
        time.sleep(8)  # whatever was held has landed by now
        mgr.save(2, _state(2))
        assert mgr.wait_durable(2, timeout=90).durable
        mgr.close(timeout=60)
    finally:
        px.rule = lambda n, method, path: None
        px.close()
    assert not os.path.exists(tmp_path / "local" / "step_00000001")  # rotated: the remote copy is the only one
    assert _same(distckpt.read(f"{url}/step_{1:08d}", storage_options=s3_bucket.storage_options), 1)


@pytest.mark.parametrize("body", [
    b'{"save_id": "ffff", "renewed_unix": 0, "lease_s": Infinity}',
    b'{"save_id": "ffff", "host": "h", "pid": 1, "renewed_unix": 9e15, "lease_s": 30}',
    b'{"save_id": ["a"], "renewed_unix": 9e15, "lease_s": 30}',
    b" " * (70 << 10) + b"{}",
], ids=["infinite-lease", "renewed-in-the-future", "save-id-a-list", "over-64KiB"])
def test_a_lease_record_no_writer_makes_is_broken_not_obeyed_for_ever(s3_bucket, s3_server, tmp_path, body):
    """A crafted or damaged lock object at the remote root (the drains' lease) made every drain
    retry for ever (SaveInProgressError), or fail for good as a "damaged checkpoint" (a record over
    64 KiB): it counts as a dead lease now, broken conditionally on its ETag, and the step drains."""
    url = f"{s3_bucket.url}/run"
    s3_bucket.fs.pipe(f"{s3_bucket.name}/run/.distckpt.lock", body)
    with TieredCheckpointManager(tmp_path / "local", url, storage_options=s3_bucket.storage_options) as mgr:
        mgr.save(1, _state(1))
        assert mgr.wait_durable(1, timeout=60).durable
    assert _same(distckpt.read(f"{url}/step_{1:08d}", storage_options=s3_bucket.storage_options), 1)
