"""One live TieredCheckpointManager per remote tier on an object store (distckpt.tiers.owner),
against the suite's SeaweedFS server: the remote tier's owner is a lease there, renewed while its
manager lives.

* a second manager (another job) is refused while the owner renews, and writes nothing; it takes
  the tier once the owner closed;
* a restart on the node whose manager was killed takes the dead manager's lease at once (it can
  prove it dead); a manager on another node waits the lease out, then takes it;
* an owner stalled past its lease (SIGSTOP) that another manager took the tier from never drains
  or rotates there again while the new owner lives: its drain retries with SaveInProgressError
  naming the new owner, whose durable step stays; once the new owner closed, it drains.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distckpt.errors import SaveInProgressError
from distckpt.tiers import TieredCheckpointManager

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "helpers" / "tiers_owner_worker.py"


def _spawn(mode: str, local: Path, remote: str, options: dict, lease_s: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIERS_OPTIONS": json.dumps(options),
           "DISTCKPT_OBJECT_LEASE_S": str(lease_s), "DISTCKPT_OBJECT_REQUEST_TIMEOUT_S": "5"}
    return subprocess.Popen([sys.executable, str(WORKER), mode, str(local), remote], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)


def _record(proc: subprocess.Popen, key: str) -> dict:
    for line in proc.stdout:
        rec = json.loads(line)
        if key in rec:
            return rec
    raise AssertionError(f"the worker ended (rc {proc.wait()}) before printing {key!r}")


def _ready_owner(mode: str, s3_bucket, tmp_path: Path, monkeypatch, lease_s: float = 3.0):
    """A worker in ``mode`` that owns the tier on ``s3_bucket``/run (local tier tmp_path/a), its
    first step durable, under a lease of ``lease_s`` (this process's too): (proc, remote, options)."""
    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", str(lease_s))
    remote, opts = f"{s3_bucket.url}/run", s3_bucket.storage_options
    proc = _spawn(mode, tmp_path / "a", remote, opts, lease_s)
    try:
        _record(proc, "ready")
    except BaseException:
        _reap(proc)
        raise
    return proc, remote, opts


def _again_durable(proc: subprocess.Popen) -> None:
    """Tell a ``lose``/``freeze`` worker to finish: its step drains once it owns the tier again."""
    proc.stdin.write("again\n")
    proc.stdin.flush()
    _record(proc, "durable")
    assert proc.wait(timeout=120) == 0


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _owner_key(bucket, prefix: str) -> str:
    return f"{prefix}/.distckpt-tiers.owner"


def test_a_second_manager_is_refused_while_the_owner_renews_and_takes_the_tier_after_close(
        s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", "2")
    remote, opts = f"{s3_bucket.url}/run", s3_bucket.storage_options
    with TieredCheckpointManager(tmp_path / "a", remote, storage_options=opts) as a:
        a.save(1, {"w": torch.arange(10.0)})
        assert a.wait_durable(1, timeout=120).durable
        t0 = time.monotonic()
        with pytest.raises(SaveInProgressError) as refused:
            TieredCheckpointManager(tmp_path / "b", remote, storage_options=opts, keep_last_remote=1)
        # Refused once the owner's heartbeat (every lease_s / 4) renewed the lease, not at its lapse.
        assert time.monotonic() - t0 < 30
        message = str(refused.value)
        assert "owns the remote tier" in message and str(tmp_path / "a") in message and "renewed" in str(
            refused.value.__cause__), message
        assert not (tmp_path / "b" / ".distckpt-tier-remote").exists()  # the refused manager wrote nothing
        assert sorted(k for k in s3_bucket.keys("run") if "MANIFEST" in k) == ["run/step_00000001/MANIFEST"]
    # Closed: the lease is gone, and the next manager takes the tier at once.
    assert _owner_key(s3_bucket, "run") not in s3_bucket.keys("run")
    with TieredCheckpointManager(tmp_path / "b", remote, storage_options=opts) as b:
        b.save(2, {"w": torch.arange(10.0) * 2})
        assert b.wait_durable(2, timeout=120).durable


def test_a_restart_takes_its_killed_predecessors_lease_at_once_and_another_node_waits_it_out(
        s3_bucket, tmp_path, monkeypatch, caplog):
    lease_s = 12.0
    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", str(lease_s))
    remote, opts = f"{s3_bucket.url}/run", s3_bucket.storage_options

    def killed_holder(local: Path) -> None:
        proc = _spawn("hold", local, remote, opts, lease_s)
        try:
            _record(proc, "ready")
        finally:
            _reap(proc)

    # The same node restarts (its local tier recorded the dead manager's id): no wait.
    killed_holder(tmp_path / "a")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        with TieredCheckpointManager(tmp_path / "a", remote, storage_options=opts):
            took = time.monotonic() - t0
    assert "at once: its holder is gone" in caplog.text, caplog.text
    assert took < lease_s, took

    # A manager on another node cannot prove the holder dead: it waits until the lease lapses.
    killed_holder(tmp_path / "a")
    killed_at = time.time()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        with TieredCheckpointManager(tmp_path / "c", remote, storage_options=opts):
            took = time.time() - killed_at
    assert "at once" not in caplog.text and "breaking the" in caplog.text, caplog.text
    assert took >= lease_s - 2 * lease_s / 4, took  # the last renewal came at most lease_s / 4 before the kill


def test_an_owner_that_lost_the_tier_while_stalled_never_drains_or_rotates_there_while_the_new_owner_lives(
        s3_bucket, tmp_path, monkeypatch):
    a, remote, opts = _ready_owner("lose", s3_bucket, tmp_path, monkeypatch)  # A's step 1 is durable
    try:
        os.killpg(a.pid, signal.SIGSTOP)  # stalled past its lease (a frozen host, a long GC pause)
        b = TieredCheckpointManager(tmp_path / "b", remote, storage_options=opts, keep_last_remote=1)
        try:
            b.save(100, {"w": torch.arange(5.0)})
            assert b.wait_durable(100, timeout=120).durable
            os.killpg(a.pid, signal.SIGCONT)
            a.stdin.write("go\n")
            a.stdin.flush()
            drain = _record(a, "drain")["drain"]
            # A's drain of step 2 met the new owner: nothing published, nothing rotated.
            assert drain["remote"] == "retrying" and drain["error"] == "SaveInProgressError", drain
            assert str(tmp_path / "b") in drain["message"], drain
            manifests = sorted(k for k in s3_bucket.keys("run") if "MANIFEST" in k)
            assert "run/step_00000100/MANIFEST" in manifests and "run/step_00000002/MANIFEST" not in manifests
            out = {"w": torch.zeros(5)}
            b.load(out, step=100)
            assert torch.equal(out["w"], torch.arange(5.0))
        finally:
            b.close()
        _again_durable(a)  # B closed: A's retry takes the tier and drains step 2
    finally:
        _reap(a)


def _stopped(pid: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never stopped")


def test_an_owner_frozen_between_its_publish_and_its_rotation_deletes_nothing_of_the_new_owner(
        s3_bucket, tmp_path, monkeypatch):
    """An outside trial froze the owner right after its drain's ownership check and before its
    rotation: once resumed, its rotation deleted a durable step of the manager that had taken the
    tier meanwhile. The rotation now proves the owner (a renewal) right before each write."""
    a, remote, opts = _ready_owner("freeze", s3_bucket, tmp_path, monkeypatch)  # A's step 10 is durable
    try:
        a.stdin.write("go\n")
        a.stdin.flush()
        _stopped(a.pid)  # step 20 published, its rotation not begun
        with TieredCheckpointManager(tmp_path / "b", remote, storage_options=opts, keep_last_remote=5) as b:
            for step in (1, 2):
                b.save(step, {"w": torch.full((5,), float(step))})
                assert b.wait_durable(step, timeout=120).durable
            os.killpg(a.pid, signal.SIGCONT)
            drain = _record(a, "drain")["drain"]
            # The renewal before the rotation's first write finds B's owner record; on a loaded
            # machine that renewal may outlive this test's short request deadline instead: either
            # way it is not proven, and the rotation writes nothing (what the manifests show).
            assert drain["error"] in ("SaveInProgressError", "EndpointUnreachableError"), drain
            # A's rotation (keep_last_remote=1) would have deleted B's step 1 and its own step 10.
            manifests = sorted(k for k in s3_bucket.keys("run") if k.endswith("/MANIFEST"))
            assert manifests == [f"run/step_{s:08d}/MANIFEST" for s in (1, 2, 10, 20)], manifests
            assert b.status(1).durable
        _again_durable(a)
    finally:
        _reap(a)


@pytest.mark.parametrize("record", ["renewed_an_hour_ahead", "a_longer_lease_than_this_process"])
def test_a_dead_owners_lease_is_taken_once_unchanged_for_its_lease_whatever_it_claims(
        s3_bucket, tmp_path, monkeypatch, record):
    """A dead owner's lease whose renewal lies an hour in this host's future (its host's clock ran
    ahead), or whose lease (10 s) is longer than this process's (3 s), was refused for as long
    as it claimed (up to a day). It is taken once the lease has stayed unchanged for the lease it
    states, as this process's own clock counts it."""
    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", "3")
    remote, opts = f"{s3_bucket.url}/run", s3_bucket.storage_options
    now = time.time()
    lease = 3.0 if record == "renewed_an_hour_ahead" else 10.0
    rec = {"host": "gone-host", "pid": 1, "save_id": "f" * 32, "what": "TieredCheckpointManager(dead)",
           "started_unix": now, "renewed_unix": now + (3600 if record == "renewed_an_hour_ahead" else 0),
           "lease_s": lease, "beat": 7, "local_root": "/nowhere"}
    s3_bucket.fs.pipe_file(f"{s3_bucket.name}/run/.distckpt-tiers.owner", json.dumps(rec).encode())
    t0 = time.monotonic()
    with TieredCheckpointManager(tmp_path / "a", remote, storage_options=opts) as mgr:
        took = time.monotonic() - t0
        mgr.save(1, {"w": torch.arange(3.0)})
        assert mgr.wait_durable(1, timeout=120).durable
    assert lease - 0.5 <= took < lease + 60, took


def test_something_else_at_the_owners_name_is_named(s3_bucket, tmp_path, monkeypatch):
    """Objects under REMOTE/.distckpt-tiers.owner/ (SeaweedFS then refuses the lease's create as
    if it existed, with nothing to read there) gave 'another save keeps taking it' naming no one."""
    from distckpt.errors import CheckpointExistsError

    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", "2")
    s3_bucket.fs.pipe_file(f"{s3_bucket.name}/run/.distckpt-tiers.owner/x", b"junk")
    with pytest.raises(CheckpointExistsError) as refused:
        TieredCheckpointManager(tmp_path / "a", f"{s3_bucket.url}/run", storage_options=s3_bucket.storage_options)
    assert not isinstance(refused.value, SaveInProgressError)
    assert "something else stands at that name" in str(refused.value), refused.value
