"""TieredCheckpointManager in one process, with a directory as the remote tier (the drain's POSIX
path: Store.copy_data_file on the POSIX store), and the local tier's first-save room check on a
real small tmpfs. The object-store tiers and the multi-node cases: tests/s3/test_tiers_*.py."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from distckpt import errors
from distckpt.tiers import TieredCheckpointManager

from ..helpers.faults import mounts  # noqa: F401  (pytest fixture)
from ..helpers.io_helpers import open_paths


def _state(step: int, n: int = 1 << 16) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(7) * step, "step": step}


def test_directory_remote_drains_rotates_and_restores(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with TieredCheckpointManager(local, remote, keep_last_local=1, keep_last_remote=2) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s))
        h = mgr.save(4, _state(4), blocking=False)
        h.result()
        status = mgr.wait_durable(4, timeout=120)
        assert status.durable and status.local == "committed" and status.sent == status.to_send > 0
    assert sorted(n for n in os.listdir(local) if n.startswith("step_")) == ["step_00000004"]
    assert sorted(n for n in os.listdir(remote) if n.startswith("step_")) == ["step_00000003", "step_00000004"]
    # The remote copy is the local one byte for byte.
    for name in os.listdir(local / "step_00000004"):
        assert (local / "step_00000004" / name).read_bytes() == (remote / "step_00000004" / name).read_bytes()
    # A new manager (a restart) restores the newest step; the local copy serves it.
    out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
    with TieredCheckpointManager(local, remote, keep_last_local=1, keep_last_remote=2) as mgr:
        result = mgr.load(out)
    assert out["step"] == 4 and torch.equal(out["w"], _state(4)["w"]) and torch.equal(out["b"], _state(4)["b"])
    assert result.bytes_by_tier["remote"] == 0 < result.bytes_by_tier["local"]
    # The local tier wiped: the remote copy serves it, bit for bit.
    import shutil
    shutil.rmtree(local)
    out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
    with TieredCheckpointManager(local, remote, keep_last_local=1) as mgr:
        result = mgr.load(out)
        assert mgr.status(4).local == "absent" and mgr.status(4).remote == "committed"
    assert out["step"] == 4 and torch.equal(out["w"], _state(4)["w"])
    assert result.bytes_by_tier["local"] == 0 < result.bytes_by_tier["remote"]


def test_a_local_save_never_asks_the_remote_tier(tmp_path):
    """Local rotation runs inside the local commit: it decides from what the manager knows the
    remote tier holds (drained by it), never by asking the remote tier, which may not answer
    (before, a black-holed remote made every local save wait a request deadline). A step the
    remote tier holds is rotated away locally all the same; one it does not is kept."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with TieredCheckpointManager(local, remote, keep_last_local=1) as mgr:
        mgr.save(1, _state(1))
        assert mgr.wait_durable(1, timeout=120).durable

        def asked(*args, **kwargs):
            raise AssertionError("a local save asked the remote tier")

        mgr._remote.steps = asked
        mgr._remote_store.committed_save_id = asked
        mgr._drainer.enqueue = lambda step, save_id: None  # step 2 is never drained
        mgr.save(2, _state(2))  # rotates step 1 away: drained, so the remote tier holds it
        mgr.save(3, _state(3))  # keeps step 2: not known to be on the remote tier
        assert sorted(n for n in os.listdir(local) if n.startswith("step_")) == ["step_00000002", "step_00000003"]
        del mgr._remote.steps, mgr._remote_store.committed_save_id, mgr._drainer.enqueue
    # The next manager finds steps 2 and 3 undrained and drains them.
    with TieredCheckpointManager(local, remote, keep_last_local=1) as mgr:
        assert mgr.wait_durable(3, timeout=120).durable


def _steps(root) -> list[int]:
    return sorted(int(n[len("step_"):]) for n in os.listdir(root) if n.startswith("step_"))


def _lag_drains(mgr):
    """Hold every later drain of ``mgr`` until the returned event is set (a drain that lags)."""
    import threading
    gate, real = threading.Event(), mgr._drainer._drain

    def lagging(*args):
        assert gate.wait(120), "the test never released the drains"
        return real(*args)

    mgr._drainer._drain = lagging
    return gate


def test_after_a_rollback_a_local_step_the_remote_tier_never_held_is_kept(tmp_path):
    """Job 1 saves 30, 40, 50 (the remote tier keeps 50, the local tier 40 and 50); job 2 rolls back
    to 40 and saves 41 and 42 while the drains lag. Step 41 is on no other tier: 42's local rotation
    must keep it (it used to count the abandoned branch's remote step 50 as "newer remote steps of
    this branch" and delete it: lost on every tier)."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with TieredCheckpointManager(local, remote, keep_last_local=2, keep_last_remote=1) as mgr:
        for s in (30, 40, 50):
            mgr.save(s, _state(s))
            mgr.wait_durable(s, timeout=120)
    assert _steps(local) == [40, 50] and _steps(remote) == [50]
    out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
    with TieredCheckpointManager(local, remote, keep_last_local=2, keep_last_remote=1) as mgr:
        mgr.load(out, step=40)
        assert out["step"] == 40
        gate = _lag_drains(mgr)
        try:
            mgr.save(41, _state(41))
            mgr.save(42, _state(42))
            assert 41 in _steps(local) and mgr.status(41).local == "committed", _steps(local)
        finally:
            gate.set()
        assert mgr.wait_durable(42, timeout=120).durable and mgr.status(41).remote != "failed"
    # 40: drained, then dropped by the remote tier's keep_last_remote; neither tier's policy keeps
    # it. 41 too remotely, but locally it is among the newest two by commit time (50 belongs to
    # the abandoned branch), so keep_last_local keeps it.
    assert _steps(local) == [41, 42, 50] and _steps(remote) == [42, 50]


def test_a_restart_does_not_drain_again_what_keep_last_remote_rotated_away(tmp_path, caplog):
    """keep_last_local=5 > keep_last_remote=2: the remote tier holds 40 and 50, the local tier 10
    to 50. Every restart drained 10, 20 and 30 again (not on the remote tier: its own rotation
    had dropped them), and each of those drains pointed the remote `latest` back at the old step
    and left the remote tier above keep_last_remote (an outside trial: after two restarts it held
    10 to 50 with `latest` at 10). They count as drained and rotated away now: nothing is sent,
    `latest` stays, and the local rotation deletes them in turn."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    for restart in range(3):
        with TieredCheckpointManager(local, remote, keep_last_local=5, keep_last_remote=2) as mgr:
            if restart == 0:
                for s in (10, 20, 30, 40, 50):
                    mgr.save(s, _state(s))
                    mgr.wait_durable(s, timeout=120)
        assert _steps(remote) == [40, 50] and (remote / "latest").read_text() == "step_00000050\n", restart
        assert _steps(local) == [10, 20, 30, 40, 50], restart
    caplog.set_level("WARNING", logger="distckpt")
    with TieredCheckpointManager(local, remote, keep_last_local=5, keep_last_remote=2) as mgr:
        assert "not draining ['step_00000010', 'step_00000020', 'step_00000030']" in caplog.text, caplog.text
        for s in (60, 70):
            mgr.save(s, _state(s))
            mgr.wait_durable(s, timeout=120)
    assert _steps(local) == [30, 40, 50, 60, 70] and _steps(remote) == [60, 70]
    assert (remote / "latest").read_text() == "step_00000070\n"


def test_a_late_drain_leaves_the_remote_latest_at_the_newest_commit(tmp_path):
    """A local step found undrained at construction, committed before a step the remote tier holds:
    its drain pointed the remote `latest` at it, the older save, where `latest` names the newest
    by commit order (what load() loads). It stays at the newer step now."""
    import distckpt
    local, elsewhere, remote = tmp_path / "local", tmp_path / "elsewhere", tmp_path / "remote"
    with TieredCheckpointManager(local, elsewhere, keep_last_local=10) as mgr:
        mgr.save(40, _state(40))
    time.sleep(0.01)
    distckpt.CheckpointManager(remote, keep_last=3).save(50, _state(50))
    os.remove(local / ".distckpt-tier-remote")  # the remote tier changed on purpose (TierMismatchError's remedy)
    with TieredCheckpointManager(local, remote, keep_last_local=10, keep_last_remote=3) as mgr:
        assert mgr.wait_durable(40, timeout=120).durable
        out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
        mgr.load(out)
        assert out["step"] == 50
    assert _steps(remote) == [40, 50] and (remote / "latest").read_text() == "step_00000050\n"


def test_wait_durable_of_a_step_rotated_away_from_both_tiers_raises(tmp_path):
    """wait_durable() of a step this manager drained that keep_last_remote (and keep_last_local)
    then dropped returned a status (durable False, on neither tier) without raising, where a new
    manager raised CheckpointNotFoundError (an outside trial): a caller that reads "no exception"
    as durable was misled."""
    with TieredCheckpointManager(tmp_path / "local", tmp_path / "remote", keep_last_local=1,
                                 keep_last_remote=1) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s))
            assert mgr.wait_durable(s, timeout=120).durable
        with pytest.raises(errors.CheckpointNotFoundError, match="rotated away"):
            mgr.wait_durable(1, timeout=5)
        assert mgr.wait_durable(3, timeout=5).durable


def test_a_drain_whose_local_copy_vanished_fails_and_the_queue_moves_on(tmp_path):
    """A queued step whose local copy is gone before its drain (deleted by hand, a lost disk)
    cannot be drained by any retry: it fails for good (CheckpointNotFoundError as the cause) and the
    next step drains (it used to be retried forever, holding every later drain behind it). close()
    names it without claiming it stays committed locally."""
    import shutil
    local, remote = tmp_path / "local", tmp_path / "remote"
    mgr = TieredCheckpointManager(local, remote, keep_last_local=5)
    try:
        gate = _lag_drains(mgr)
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        shutil.rmtree(local / "step_00000001")
        gate.set()
        assert mgr.wait_durable(2, timeout=60).durable
        with pytest.raises(errors.NotDurableError) as info:
            mgr.wait_durable(1, timeout=60)
        assert isinstance(info.value.cause, errors.CheckpointNotFoundError), info.value
        assert mgr.status(1).remote == "failed" and mgr.status(1).local == "absent"
        assert "still committed locally" not in str(info.value)
    finally:
        gate.set()
        with pytest.raises(errors.NotDurableError) as closed:
            mgr.close(timeout=5)   # bounded: before the fix, step 1 was retried until close's timeout
    assert closed.value.steps == [1]
    assert "stay committed locally" not in str(closed.value) and "not on this node's local tier" in str(closed.value)


def test_an_undrained_local_step_is_drained_by_the_next_manager(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    # A run whose drains never happened: steps committed on the local tier only (as after a crash).
    from distckpt.tiers import manager as tm
    mgr = TieredCheckpointManager(local, remote, keep_last_local=3)
    mgr._drainer.close(5)  # the drain thread stopped before any save (a crash right after the saves)
    mgr.save(5, _state(5))
    mgr.save(6, _state(6))
    assert not (remote / "step_00000005").exists()
    # One manager per local tier: a second one is refused while the first is open.
    with pytest.raises(errors.SaveInProgressError, match="another TieredCheckpointManager"):
        TieredCheckpointManager(local, tmp_path / "elsewhere")
    with pytest.raises(errors.NotDurableError) as info:
        mgr.close()
    assert info.value.steps == [5, 6]
    with TieredCheckpointManager(local, remote, keep_last_local=3) as again:
        again.wait_durable(6, timeout=120)
        assert again.status(5).durable and again.status(6).durable
    assert tm.TierStatus  # the public status type


def test_a_newer_step_with_no_complete_copy_is_named_when_the_load_goes_back(tmp_path, caplog):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s))
        mgr.wait_durable(3, timeout=120)
    # Step 3 never reached the remote tier (its drain lost), and its local data file is gone.
    import shutil
    shutil.rmtree(remote / "step_00000003")
    os.unlink(local / "step_00000003" / "rank00000.bin")
    caplog.set_level("WARNING", logger="distckpt")
    out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        # At start: it cannot be drained, and the warning says what it lacks.
        start = [r.getMessage() for r in caplog.records]
        assert any("step 3 is committed on the local tier but cannot be drained" in m and "rank00000.bin" in m
                   for m in start), start
        caplog.clear()
        assert mgr.latest_step() == 2
        result = mgr.load(out)
    assert out["step"] == 2 and torch.equal(out["w"], _state(2)["w"])
    # ... and the result names it too (LoadResult.passed_over), for a resume loop to see
    assert list(result.passed_over) == [3] and "rank00000.bin" in result.passed_over[3], result.passed_over
    # The load went back a step: it names the step it passed over and the file it lacks.
    said = [r.getMessage() for r in caplog.records]
    assert any("step 3" in m and "passed over for step 2" in m and "rank00000.bin" in m for m in said), said
    with pytest.raises(errors.TierIncompleteError, match="rank00000.bin"):
        with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
            mgr.load(out, step=3)


def test_a_step_of_a_newer_format_version_is_not_passed_over(tmp_path, caplog):
    """Step 3 written by a newer release (a MANIFEST format version this reader does not know),
    on both tiers: the tiered manager counted it as damaged, warned, and loaded step 2 (the plain
    CheckpointManager raises). It raises the typed error naming the version (when it is built: its
    first drain scan reads every step of both tiers), and keeps step 3 on both."""
    import struct
    local, remote = tmp_path / "local", tmp_path / "remote"
    with TieredCheckpointManager(local, remote, keep_last_local=5) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s))
        mgr.wait_durable(3, timeout=120)
    for tier in (local, remote):
        man = tier / "step_00000003" / "MANIFEST"
        data = bytearray(man.read_bytes())
        struct.pack_into("<I", data, 8, 99)  # the header's format_version, after the 8-byte magic
        man.write_bytes(bytes(data))
    out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
    with pytest.raises(errors.ManifestCorruptError, match="format version 99"):
        with TieredCheckpointManager(local, remote, keep_last_local=5) as mgr:
            mgr.load(out)
    assert out["step"] == -1
    assert (local / "step_00000003" / "MANIFEST").exists() and (remote / "step_00000003" / "MANIFEST").exists()
    # Nothing of the manager that failed to build stays held: its owner locks leaked (an fd each),
    # and a second try in this process was refused by them (SaveInProgressError) instead of
    # raising the same error again.
    assert not [p for p in open_paths() if ".distckpt-tiers.owner" in p], open_paths()
    with pytest.raises(errors.ManifestCorruptError, match="format version 99"):
        TieredCheckpointManager(local, remote, keep_last_local=5)


def test_a_step_committed_before_an_error_after_its_commit_is_drained(tmp_path, monkeypatch):
    """The local commit succeeded, then the work after it failed (the local rotation here; a
    `latest` update could): the save raises with committed=True, and the step was never queued
    for the drain, so it stayed on this node's disk only. It is drained like any other."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    failures = []

    def failing_rotation(self, keep):
        failures.append(keep)
        raise errors.StorageIOError("rotation failed: [Errno 5] Input/output error", path=str(local), errno=errno.EIO)

    with TieredCheckpointManager(local, remote, keep_last_local=1) as mgr:
        monkeypatch.setattr(TieredCheckpointManager, "_rotate_local", failing_rotation)
        with pytest.raises(errors.StorageIOError) as info:
            mgr.save(1, _state(1))
        assert info.value.committed is True and failures
        mgr.wait_durable(1, timeout=120)
    assert (remote / "step_00000001" / "MANIFEST").exists()


def test_a_damaged_local_index_is_named_by_its_local_path(tmp_path):
    from distckpt import manifest as mf
    local, remote = tmp_path / "local", tmp_path / "remote"
    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        mgr.save(1, _state(1))
        mgr.wait_durable(1, timeout=120)
    step = local / "step_00000001"
    header = mf.decode_header((step / "MANIFEST").read_bytes())
    off = header.files[0].index[0]
    with open(step / "rank00000.bin", "r+b") as f:  # one bit of the local copy's index
        f.seek(off + 5)
        b = f.read(1)
        f.seek(off + 5)
        f.write(bytes([b[0] ^ 1]))
    from distckpt.tiers.load import load_tiered
    out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
    with pytest.raises(errors.ChecksumMismatchError) as info:
        load_tiered(out, local_path=str(step), remote_path=str(remote / "step_00000001"))
    # The copy that was read is the damaged one, not the remote tier's intact file (the manager's
    # load relies on it: a damaged local file is read again from the remote tier).
    assert info.value.path == str(step / "rank00000.bin"), info.value.path
    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        mgr.load(out, step=1)
    assert out["step"] == 1 and torch.equal(out["w"], _state(1)["w"])


def test_a_damaged_local_data_file_is_named_and_the_step_loaded_from_the_remote_tier(tmp_path, caplog):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        mgr.save(1, _state(1))
        mgr.wait_durable(1, timeout=120)

    def flip(path):
        raw = bytearray(path.read_bytes())
        raw[100] ^= 1  # inside the first chunk
        path.write_bytes(bytes(raw))

    flip(local / "step_00000001" / "rank00000.bin")
    caplog.set_level("WARNING", logger="distckpt")
    out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        result = mgr.load(out)
    assert out["step"] == 1 and torch.equal(out["w"], _state(1)["w"]) and torch.equal(out["b"], _state(1)["b"])
    assert result.bytes_by_tier["local"] == 0 < result.bytes_by_tier["remote"]
    said = [r.getMessage() for r in caplog.records]
    damaged = str(local / "step_00000001" / "rank00000.bin")
    assert any("are damaged" in m and damaged in m and "from the remote tier" in m for m in said), said
    # Both copies damaged: the remote copy's error, by its path; nothing unverified was copied.
    flip(remote / "step_00000001" / "rank00000.bin")
    out = {"w": torch.full((1 << 16,), 7.0), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        with pytest.raises(errors.ChecksumMismatchError) as info:
            mgr.load(out)
    assert info.value.path == str(remote / "step_00000001" / "rank00000.bin")
    assert bool((out["w"] == 7.0).all())


def test_first_save_checks_room_for_keep_last_local_steps(tmp_path, mounts):
    small = mounts.tmpfs(tmp_path / "nvme", size="6m")
    remote = tmp_path / "remote"
    mgr = TieredCheckpointManager(small, remote, keep_last_local=8)
    try:
        with pytest.raises(errors.DiskFullError) as info:
            mgr.save(1, _state(1, n=1 << 18))  # 1 MiB per step: 8 more do not fit beside it in 6 MiB
        err = info.value
        assert err.committed is True and "keep_last_local=8" in str(err) and err.needed > err.free
        assert mgr.status(1).local == "committed"  # the step itself is saved, and drains
        mgr.wait_durable(1, timeout=120)
    finally:
        mgr.close()


def test_a_memory_tier_is_checked_against_the_hosts_memory(tmp_path, mounts):
    """A local tier in host memory: a tmpfs sized far beyond the RAM left (its size check passes)
    is refused at the first save when keep_last_local steps would not fit in available memory,
    since a full tmpfs ends in the OOM killer, not ENOSPC. Typed, the step itself committed."""
    from distckpt.storage.posix.guards import memory_available
    step_bytes = 1 << 20
    keep = memory_available() // step_bytes + 64  # keep x 1 MiB: more than the host has
    big = mounts.tmpfs(tmp_path / "shm", size=f"{2 * keep * step_bytes}")  # the tmpfs allows it
    mgr = TieredCheckpointManager(big, tmp_path / "remote", keep_last_local=keep)
    try:
        with pytest.raises(errors.DiskFullError) as info:
            mgr.save(1, _state(1, n=1 << 18))
        err = info.value
        assert err.committed is True and err.errno == errno.ENOMEM and err.needed > err.free
        assert "memory tier" in str(err) and "tmpfs" in str(err) and f"keep_last_local={keep}" in str(err)
        assert mgr.status(1).local == "committed"
        mgr.wait_durable(1, timeout=120)
    finally:
        mgr.close()
    # Within memory: no error, and the same tmpfs holds the tier.
    with TieredCheckpointManager(mounts.tmpfs(tmp_path / "shm2", size="64m"), tmp_path / "remote2",
                                 keep_last_local=2) as mgr:
        mgr.save(1, _state(1, n=1 << 18))
        mgr.wait_durable(1, timeout=120)


def test_bad_arguments_are_typed_and_write_nothing(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    for kwargs in ({"keep_last_local": 0}, {"keep_last_local": True}):
        with pytest.raises(errors.ConfigError):
            TieredCheckpointManager(local, remote, **kwargs)
    with pytest.raises(errors.ConfigError):
        TieredCheckpointManager("s3://bucket/x", remote)
    with pytest.raises(errors.ConfigError):
        TieredCheckpointManager(local, local)
    assert not local.exists() and not remote.exists()
    with TieredCheckpointManager(local, remote) as mgr:
        for step in (-1, 1.5, True):
            with pytest.raises(errors.ConfigError):
                mgr.save(step, _state(0))
        with pytest.raises(errors.ConfigError):
            mgr.save(1, _state(1), incremental=object())
        with pytest.raises(errors.CheckpointNotFoundError):
            mgr.load(_state(0))
        with pytest.raises(errors.CheckpointNotFoundError):
            mgr.wait_durable(9)
        # Steps and timeouts of the wrong type (bare ValueError or TypeError before, an outside
        # trial; close() had already marked the manager closed when it raised).
        for call in (lambda: mgr.load(_state(0), step="1"), lambda: mgr.load(_state(0), step=-1),
                     lambda: mgr.status("1"), lambda: mgr.status(None), lambda: mgr.wait_durable("1"),
                     lambda: mgr.wait_durable(9, timeout="5"), lambda: mgr.close(timeout="x"),
                     lambda: mgr.local_path(1.0), lambda: mgr._local.load(_state(0), step="1"),
                     lambda: mgr._local.save(True, _state(0)), lambda: mgr._local.path("1")):
            with pytest.raises(errors.ConfigError):
                call()
        mgr.save(1, _state(1))  # still open
        assert mgr.wait_durable(1, timeout=60).durable
    with pytest.raises(errors.ConfigError):
        mgr.save(1, _state(1))  # closed
    mgr.close()  # idempotent


def test_a_drain_thread_stopped_by_a_lost_peer_is_restarted_by_the_next_save(tmp_path):
    """A drain that loses a peer stops the drain thread (nothing can be agreed on its channel any
    more) while training goes on. The steps saved after that used to stay on the local tier only
    (never drained, never rotated away) until the job restarted. Now the next save starts a new
    drain thread, queues the step the old one left first, then its own (the multi-rank case, with
    a real stalled peer: tests/protocol/test_tiers_manager_ranks.py)."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    mgr = TieredCheckpointManager(local, remote, keep_last_local=5)
    real = mgr._drainer._drain

    def lose_a_peer(*args):
        raise errors.PeerLostError("all_gather among 2 ranks failed: a peer was paused past the drain timeout")

    mgr._drainer._drain = lose_a_peer
    try:
        mgr.save(1, _state(1))
        with pytest.raises(errors.NotDurableError) as info:
            mgr.wait_durable(1, timeout=30)
        assert isinstance(info.value.cause, errors.PeerLostError), info.value
        mgr._drainer._thread.join(30)
        assert not mgr._drainer.alive
        mgr._drainer._drain = real  # the peer is back
        mgr.save(2, _state(2))
        assert mgr._drainer.alive
        assert mgr.wait_durable(1, timeout=60).durable and mgr.wait_durable(2, timeout=60).durable
    finally:
        mgr.close(timeout=30)
    assert {"step_00000001", "step_00000002"} <= set(os.listdir(remote))


def _hold_local_commits(mgr):
    """Hold every later local commit of ``mgr`` (inside the commit, before its drain is queued)
    until the returned event is set: an async local save still in flight."""
    import threading
    gate, real = threading.Event(), mgr._after_local_commit

    def holding(step):
        assert gate.wait(120), "the test never released the local commit"
        return real(step)

    mgr._after_local_commit = holding
    return gate


def test_wait_durable_right_after_an_async_save_waits_for_the_local_commit(tmp_path):
    """wait_durable(step) called while the async local save of step is still in flight used to
    raise NotDurableError "never queued for draining" at once. It waits for the local commit
    (within its timeout), then for the drain."""
    import threading
    local, remote = tmp_path / "local", tmp_path / "remote"
    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        gate = _hold_local_commits(mgr)
        try:
            handle = mgr.save(1, _state(1), blocking=False)
            assert not handle.done() and mgr.status(1).local == "saving"
            # Within its timeout: the local save is still in flight (the timeout's error, not "never queued").
            t0 = time.monotonic()
            with pytest.raises(errors.NotDurableError, match="local save is still in flight") as info:
                mgr.wait_durable(1, timeout=0.5)
            assert 0.4 < time.monotonic() - t0 < 5 and info.value.steps == [1]
            threading.Timer(0.5, gate.set).start()  # the local commit completes while wait_durable waits
            status = mgr.wait_durable(1, timeout=120)
        finally:
            gate.set()
        assert status.durable and status.local == "committed", status
        assert handle.result().save_id == status.save_id
        assert (remote / "step_00000001" / "MANIFEST").exists()


def test_wait_durable_raises_the_error_of_a_failed_async_local_save(tmp_path, monkeypatch):
    """An async local save that fails in the background: wait_durable raises that save's own error
    (its class), which then counts as seen (the next save does not raise it again)."""
    import threading
    from distckpt.tiers import localcommit
    local, remote = tmp_path / "local", tmp_path / "remote"
    gate, real = threading.Event(), localcommit.finish_node_save

    def failing(*args, **kwargs):
        assert gate.wait(120)
        raise errors.DiskFullError("no room left for the test", path=str(local), needed=2, free=1)

    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        monkeypatch.setattr(localcommit, "finish_node_save", failing)
        handle = mgr.save(1, _state(1), blocking=False)
        threading.Timer(0.5, gate.set).start()
        with pytest.raises(errors.DiskFullError, match="no room left for the test"):
            mgr.wait_durable(1, timeout=60)
        assert handle.done()
        with pytest.raises(errors.DiskFullError):  # asked again: the same answer
            mgr.wait_durable(1, timeout=5)
        monkeypatch.setattr(localcommit, "finish_node_save", real)
        mgr.save(2, _state(2))  # the failure was handed to the caller: not raised again here
        assert mgr.wait_durable(2, timeout=120).durable
        # The step saved again (blocking) replaces the failed save: its drain is what wait_durable waits for.
        mgr.save(1, _state(1))
        assert mgr.wait_durable(1, timeout=120).durable


def test_status_of_a_step_this_manager_drained_is_known_without_asking_the_remote_tier(tmp_path):
    """A step this manager drained is on the remote tier as far as it knows: status and
    wait_durable answer without a request (they used to ask, and raised once the remote tier went
    dark). Where the manager does not know, it still asks: a step found there at construction, and
    one its keep_last_remote rotation may have dropped since (then ``absent`` when it did)."""
    local, remote = tmp_path / "local", tmp_path / "remote"

    def dark(*args, **kwargs):
        raise errors.EndpointUnreachableError("the remote tier went dark (test)")

    with TieredCheckpointManager(local, remote, keep_last_local=5) as mgr:
        mgr.save(1, _state(1))
        drained = mgr.wait_durable(1, timeout=120)
        mgr._remote_store.committed_save_id = dark
        st = mgr.status(1)
        assert st.durable and st.local == "committed" and st.save_id == drained.save_id, st
        assert mgr.wait_durable(1, timeout=5).durable
        del mgr._remote_store.committed_save_id
    with TieredCheckpointManager(local, remote, keep_last_local=5, keep_last_remote=1) as mgr:
        mgr._remote_store.committed_save_id = dark
        with pytest.raises(errors.EndpointUnreachableError):  # found at construction: not drained here, asked
            mgr.status(1)
        del mgr._remote_store.committed_save_id
        mgr.save(2, _state(2))
        assert mgr.wait_durable(2, timeout=120).durable
        mgr._remote_store.committed_save_id = dark
        assert mgr.status(2).durable  # drained here, the newest: kept by keep_last_remote=1
        with pytest.raises(errors.EndpointUnreachableError):
            mgr.status(1)   # step 2's drain may have rotated it away: asked
        del mgr._remote_store.committed_save_id
        assert mgr.status(1).remote == "absent" and mgr.status(1).local == "committed"  # it did
    assert _steps(remote) == [2]


def test_undrained_steps_of_a_rollback_drain_in_commit_order_and_rotation_keeps_the_resumed_branch(tmp_path):
    """Steps 450, 480, 500 then, after a rollback to 450, 460 and 470 were committed locally while
    the remote tier did not hold them (here: saved through a manager draining elsewhere). The next
    manager drains them. Drained by number, 500 went last and its keep_last_remote rotation (by
    number, at or below the drained step) deleted 460 and 470 remotely; local rotation then
    deleted them too (held remotely, then rotated away), and load() returned the abandoned 500.
    Now they drain oldest commit first, and rotation keeps the newest steps by commit time as well
    as by number: load() returns 470, the newest trained state, and the next save keeps it."""
    local, elsewhere, remote = tmp_path / "local", tmp_path / "elsewhere", tmp_path / "remote"
    with TieredCheckpointManager(local, elsewhere, keep_last_local=10) as mgr:
        for s in (450, 480, 500, 460, 470):  # commit order: a rollback to 450 after 500
            mgr.save(s, _state(s))
            time.sleep(0.01)
    os.remove(local / ".distckpt-tier-remote")  # the remote tier changed on purpose (TierMismatchError's remedy)
    with TieredCheckpointManager(local, remote, keep_last_local=2, keep_last_remote=2) as mgr:
        for s in (460, 470, 480, 500):
            mgr.wait_durable(s, timeout=120)
        # 450 (committed first, numbered lowest) is among neither the newest two by number nor
        # by commit time: the remote tier's rotation would delete it at once, so it is not sent.
        with pytest.raises(errors.NotDurableError, match="keep_last_remote=2 rotation would delete it"):
            mgr.wait_durable(450, timeout=10)
    out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
    with TieredCheckpointManager(local, remote, keep_last_local=2, keep_last_remote=2) as mgr:
        mgr.load(out)
        assert out["step"] == 470 and torch.equal(out["w"], _state(470)["w"])
        held = sorted(n for n in os.listdir(remote) if n.startswith("step_"))
        assert {"step_00000460", "step_00000470"} <= set(held), held
        # The next save is numbered above the abandoned branch (480 and 500 stay: this manager did
        # not roll back). Rotation by number alone kept 500 and 510 on both tiers and deleted the
        # resumed 470; the newest by commit time stay too.
        mgr.save(510, _state(510))
        assert mgr.wait_durable(510, timeout=120).durable
    assert _steps(remote) == [470, 500, 510]
    assert _steps(local) == [470, 500, 510]


def test_a_late_drain_never_rotates_away_a_step_committed_after_it(tmp_path):
    """CheckpointManager.rotate_after (what a drain runs on the remote root) for a step committed
    before newer ones: keep_last counts steps at or below it by number, which after a rollback
    are the resumed branch's newest steps; those committed after it stay."""
    import distckpt
    from distckpt import CheckpointManager

    root = tmp_path / "root"
    for s in (450, 480, 500, 460, 470):
        distckpt.save(_state(s), root / f"step_{s:08d}")
        time.sleep(0.01)
    mgr = CheckpointManager(root, keep_last=2)
    mgr.rotate_after(500)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == [
        "step_00000460", "step_00000470", "step_00000480", "step_00000500"]


@pytest.mark.parametrize("below", ["run7", ""])
def test_a_remote_tier_whose_file_system_is_not_mounted_is_refused_not_drained_into(tmp_path, below):
    """A directory remote tier on a file system that is not mounted (a bind mount here) reads as an
    empty directory, or an absent one below the mount point. The manager used to take it as an
    empty remote tier: the drain created it on this machine's own disk, reported the new steps
    durable, rotated them away locally, and the restart after the mount came back resumed from an
    older step, silently. The remote tier now has an identity that each node's local tier
    records: the unmounted root is a TierMismatchError, before anything is written; mounted again,
    the same local tier drains on, and a replaced node (an empty local tier) takes the identity."""
    import subprocess

    store, mnt, local = tmp_path / "store", tmp_path / "mnt", tmp_path / "local"
    store.mkdir()
    mnt.mkdir()
    remote = mnt / below if below else mnt

    def bind() -> None:
        subprocess.run(["mount", "--bind", str(store), str(mnt)], check=True, capture_output=True, timeout=60)

    def unbind() -> None:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60)

    bind()
    try:
        with TieredCheckpointManager(local, remote, keep_last_local=1) as mgr:
            for s in (1, 2):
                mgr.save(s, _state(s))
            assert mgr.wait_durable(2, timeout=120).durable
        unbind()
        with pytest.raises(errors.TierMismatchError) as info:
            TieredCheckpointManager(local, remote, keep_last_local=1)
        assert info.value.found is None and list(info.value.recorded) == [0], info.value
        assert "mounted" in str(info.value)
        assert os.listdir(mnt) == []  # nothing created where the remote tier should be
        bind()
        with TieredCheckpointManager(local, remote, keep_last_local=1) as mgr:
            mgr.save(3, _state(3))
            assert mgr.wait_durable(3, timeout=120).durable
        import shutil
        shutil.rmtree(local)  # a replaced node: it takes the remote tier's identity
        out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
        with TieredCheckpointManager(local, remote, keep_last_local=1) as mgr:
            mgr.load(out)
        assert out["step"] == 3 and torch.equal(out["w"], _state(3)["w"])
        # Another remote tier (a changed path) is refused too, naming both identities.
        other = tmp_path / "other"
        with TieredCheckpointManager(tmp_path / "local2", other) as mgr:
            pass
        with pytest.raises(errors.TierMismatchError) as info:
            TieredCheckpointManager(local, other)
        assert info.value.found is not None and info.value.found != info.value.recorded[0]
    finally:
        unbind()


def test_a_second_job_on_one_remote_tier_is_refused_and_a_local_copy_of_another_save_is_named(tmp_path, caplog):
    """Two jobs saving into one remote tier (a misconfiguration an outside trial made) rotate
    away each other's durable steps: the second manager is now refused while the first is open
    (the remote tier's owner, distckpt.tiers.owner), and takes the tier once the first closed.
    A node whose local copy of a step is another save than the remote tier's (here: a local tier
    re-paired on purpose with another remote root) loads the remote tier's save, the reference,
    and names its own copy it passes over (it did so without a word)."""
    remote = tmp_path / "remote"
    with TieredCheckpointManager(tmp_path / "a", remote) as a:
        with pytest.raises(errors.SaveInProgressError) as refused:
            TieredCheckpointManager(tmp_path / "b", remote, keep_last_remote=1)
        assert str(tmp_path / "a") in str(refused.value) and "own remote root" in str(refused.value)
        a.save(10, _state(10))
        assert a.wait_durable(10, timeout=120).durable
    assert not (tmp_path / "b" / ".distckpt-tier-remote").exists()  # the refused manager recorded nothing
    # B ran on a remote root of its own, then its local tier was pointed at A's on purpose
    # (the documented remedy of a moved remote tier: delete the record).
    with TieredCheckpointManager(tmp_path / "b", tmp_path / "other") as b:
        b.save(10, _state(11))
        assert b.wait_durable(10, timeout=120).durable
    os.unlink(tmp_path / "b" / ".distckpt-tier-remote")
    out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
    with TieredCheckpointManager(tmp_path / "b", remote) as b:
        caplog.clear()
        with caplog.at_level("WARNING", logger="distckpt"):
            b.load(out, step=10)
    assert out["step"] == 10 and torch.equal(out["w"], _state(10)["w"])  # the remote tier's save: job A's
    said = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
    assert said and str(tmp_path / "b" / "step_00000010") in said[0], caplog.text


def test_a_closed_managers_drain_thread_never_takes_the_remote_tier_again(tmp_path):
    """An outside trial: a manager whose drain thread was still watching another owner's lease
    when close() returned took the remote tier once that lease lapsed, after close had released
    it, and kept it (renewed) for as long as its process lived: every later job was refused. A
    closed manager's owner now refuses to take or hold the tier (here asked directly, as that
    thread's next drain step would)."""
    remote = tmp_path / "remote"
    mgr = TieredCheckpointManager(tmp_path / "a", remote)
    mgr.close()
    assert not (remote / ".distckpt-tiers.owner").exists()
    for call in (lambda: mgr._remote_owner.take(), lambda: mgr._remote_owner.hold("prepare a drain")):
        with pytest.raises(errors.SaveInProgressError, match="was closed"):
            call()
    assert not (remote / ".distckpt-tiers.owner").exists()
    with TieredCheckpointManager(tmp_path / "b", remote) as other:  # another job takes the tier at once
        other.save(1, _state(1))
        assert other.wait_durable(1, timeout=120).durable


def test_a_local_tier_wiped_under_its_manager_is_never_shared_with_a_second_one(tmp_path):
    """An outside trial: the local directory removed under a live manager (a disk cleaned by hand)
    took its owner lock and its pairing record with it; the manager's next save recreated the
    directory, and a second manager built on it (paired with another remote tier) drained the
    first one's step into its own remote, each manager unaware of the other. The manager checks
    its owner lock at each save, listing and load now: SaveInProgressError, nothing is written or
    read, and the directory is the second manager's alone."""
    import shutil
    local, r1, r2 = tmp_path / "local", tmp_path / "r1", tmp_path / "r2"
    first = TieredCheckpointManager(local, r1)
    try:
        first.save(10, _state(10))
        assert first.wait_durable(10, timeout=120).durable
        shutil.rmtree(local)
        with pytest.raises(errors.SaveInProgressError, match="removed or replaced"):
            first.save(20, _state(20))
        assert not (local / "step_00000020").exists()
        with TieredCheckpointManager(local, r2) as second:   # the directory is free for a new manager
            second.save(40, _state(40))
            assert second.wait_durable(40, timeout=120).durable
            with pytest.raises(errors.SaveInProgressError):
                first.save(30, _state(30))   # never into the second manager's directory
            # nor does it list or load the second manager's steps as its own (a re-trial: step 40)
            with pytest.raises(errors.SaveInProgressError):
                first.latest_step()
            for step in (None, 40):
                with pytest.raises(errors.SaveInProgressError):
                    first.load(_state(0), step=step)
        assert (r1 / "step_00000010").exists()
        assert not (r1 / "step_00000040").exists() and not (r2 / "step_00000010").exists()
        assert not (local / "step_00000030").exists()
    finally:
        first.close()


def test_dead_leftovers_of_any_step_are_reclaimed_and_a_peer_transfer_area_is_not_a_saves(tmp_path):
    """A save killed mid-write leaves ``.step_N.tmp-*`` in the local tier. A tiered save reclaimed
    only leftovers of its own step number, and steps only go up: each kill leaked up to a step of
    disk for good, where a CheckpointManager's save reclaims the whole root (an outside trial).
    Each save now reclaims dead leftovers of every step (never a live save's). Peer transfers'
    areas are named ``.step_N.peer-*``, which a save's reclaim never takes for a dead save's (it
    would delete one in flight on the drain thread); a manager's construction removes the ones
    that died."""
    import uuid
    local, remote = tmp_path / "local", tmp_path / "remote"
    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        mgr.save(1, _state(1))
    crashed = local / f".step_00000002.tmp-{uuid.uuid4().hex}"
    crashed.mkdir()
    (crashed / "rank00000.bin").write_bytes(b"\0" * (1 << 20))
    peer = local / f".step_00000001.peer-{uuid.uuid4().hex}"
    peer.mkdir()
    (peer / "rank00001.bin").write_bytes(b"\0" * 4096)
    with TieredCheckpointManager(local, remote, keep_last_local=2) as mgr:
        assert not peer.exists()          # removed at construction
        assert crashed.exists()
        mgr.save(3, _state(3))
        assert not crashed.exists()       # reclaimed by the save of another step
        out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
        mgr.load(out)
    assert out["step"] == 3 and torch.equal(out["w"], _state(3)["w"])
    assert not [p.name for p in local.iterdir() if ".tmp-" in p.name or ".peer-" in p.name or ".del-" in p.name]


def test_ls_of_a_local_tier_with_a_remote_root_that_is_not_its_remote_tier_says_so(tmp_path):
    """`distckpt ls LOCAL --remote R` with R another run's remote tier printed one merged table
    (that run's steps as committed and latest), exit 0, and with R a path that is not there every
    step as not remote, exit 0, while a manager on the same pair raises TierMismatchError (an
    outside trial). It now checks the pairing as the manager does: NOT PAIRED, exit 1."""
    import json
    import subprocess
    import sys
    for run, steps in (("a", (1, 2)), ("b", (7, 8))):
        with TieredCheckpointManager(tmp_path / run / "local", tmp_path / run / "remote") as mgr:
            for s in steps:
                mgr.save(s, _state(s))
                mgr.wait_durable(s, timeout=60)

    def ls(remote, *extra):
        return subprocess.run([sys.executable, "-m", "distckpt", "ls", str(tmp_path / "a" / "local"), "--remote",
                               str(remote), *extra], capture_output=True, text=True, timeout=120)
    ok = ls(tmp_path / "a" / "remote")
    assert ok.returncode == 0 and "NOT PAIRED" not in ok.stderr, ok.stderr
    (tmp_path / "a_file").write_text("x")
    for other, said in ((tmp_path / "b" / "remote", "holds tier"), (tmp_path / "a" / "typo", "no tier identity"),
                        (tmp_path / "a_file", "cannot hold a tier")):
        got = ls(other)
        assert got.returncode == 1 and "NOT PAIRED" in got.stderr and said in got.stderr, (other, got.stderr)
        doc = json.loads(ls(other, "--json").stdout)
        assert said in doc["not_paired"], doc
    with pytest.raises(errors.TierMismatchError):
        TieredCheckpointManager(tmp_path / "a" / "local", tmp_path / "b" / "remote")
    # A plain `ls` of a node's local tier says what its "committed" cannot tell: the other nodes'
    # files (a step killed between the nodes' publishes was listed committed and latest, silently).
    plain = subprocess.run([sys.executable, "-m", "distckpt", "ls", str(tmp_path / "a" / "local")],
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "one node's local tier of a tiered checkpoint" in plain.stdout, plain.stdout
    plain = subprocess.run([sys.executable, "-m", "distckpt", "ls", str(tmp_path / "a" / "remote")],
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "one node's local tier" not in plain.stdout, plain.stdout


def test_a_read_only_remote_tier_is_refused_at_construction_with_the_way_to_load_from_it(tmp_path):
    """A job that only loads, its remote tier mounted read-only: the manager's construction
    raised StoragePermissionError about saving ("remount it read-write or save elsewhere"), which
    left a job that never saves without a way forward (an outside trial). The error now says why
    the manager needs the remote writable (it owns it while it lives) and how to load from a
    read-only copy; that way loads the step exactly."""
    import subprocess

    import distckpt
    from distckpt import CheckpointManager
    local, remote, ro = tmp_path / "local", tmp_path / "remote", tmp_path / "ro"
    with TieredCheckpointManager(local, remote) as mgr:
        mgr.save(1, _state(1))
        mgr.wait_durable(1, timeout=60)
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(remote), str(ro)], check=True, timeout=60)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True, timeout=60)
        with pytest.raises(errors.StoragePermissionError) as info:
            TieredCheckpointManager(local, ro)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "needs" in notes and "writable even in a job that only loads" in notes, notes
        out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
        CheckpointManager(str(ro)).load(out)
        assert out["step"] == 1 and torch.equal(out["w"], _state(1)["w"])
        distckpt.load(out, str(ro / "step_00000001"))
    finally:
        subprocess.run(["umount", "-l", str(ro)], timeout=60)


def test_a_saves_reclaim_never_takes_a_records_temporary_for_a_dead_saves(tmp_path, monkeypatch):
    """A tiered save reclaims dead leftovers of every step. Its first version reclaimed every
    name, and the drained record, which the drain thread replaces (a temporary, then a rename)
    without the root lock, leaves a temporary of the same form (``..distckpt-tier-drained.tmp-*``):
    a save that ran meanwhile deleted it and the record was lost (an outside trial). Only steps'
    leftovers are reclaimed now."""
    import threading

    from distckpt.storage.posix import store as posix_store
    local, remote = tmp_path / "local", tmp_path / "remote"
    real = posix_store.PosixStore.replace_pointer
    held, go = threading.Event(), threading.Event()

    def slow(self, path, data):   # the drained record's temporary stays while a save reclaims
        if path.endswith(".distckpt-tier-drained"):
            tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{'0' * 32}")
            with open(tmp, "wb") as f:
                f.write(data)
            held.set()
            go.wait(30)
            os.replace(tmp, path)
            return None
        return real(self, path, data)
    monkeypatch.setattr(posix_store.PosixStore, "replace_pointer", slow)
    with TieredCheckpointManager(local, remote, keep_last_local=5) as mgr:
        mgr.save(1, _state(1))
        assert held.wait(60)
        mgr.save(2, _state(2))        # reclaims while the record's temporary is there
        go.set()
        mgr.wait_durable(2, timeout=60)
    lines = (local / ".distckpt-tier-drained").read_text().splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["1", "2"], lines


def test_load_of_a_step_whose_async_save_is_in_flight_waits_for_it_and_status_names_a_damaged_copy(tmp_path):
    """load(step=N) right after save(N, blocking=False) raised CheckpointNotFoundError ("no node's
    local directory does"), silent about the save in flight; and status(N) of a step whose local
    MANIFEST does not decode raised ManifestCorruptError where a load passes that copy over (a
    re-trial). The load now waits for this manager's async save of the step; status says
    ``damaged``."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with TieredCheckpointManager(local, remote, keep_last_local=5) as mgr:
        mgr.save(1, _state(1), blocking=False)
        out = {"w": torch.zeros(1 << 16), "b": torch.zeros(7, dtype=torch.int64), "step": -1}
        mgr.load(out, step=1)
        assert out["step"] == 1 and torch.equal(out["w"], _state(1)["w"])
        mgr.wait_durable(1, timeout=60)
        manifest = local / "step_00000001" / "MANIFEST"
        manifest.write_bytes(manifest.read_bytes()[:40])
        st = mgr.status(1)
        assert st.local == "damaged" and st.remote == "committed", st


def test_an_async_save_that_fails_at_its_plan_is_not_saving_for_ever(tmp_path):
    """An async tiered save whose plan fails (a value no save can store): the handle ended with
    the error, but the manager was never told and status(step).local said 'saving' for good (a
    re-trial). It says 'absent' now, and the handle has the error."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with TieredCheckpointManager(local, remote) as mgr:
        handle = mgr.save(2, {"w": torch.ones(4), "bad": object()}, blocking=False)
        handle.wait()
        assert isinstance(handle.exception(), errors.DistCkptError), handle.exception()
        assert mgr.status(2).local == "absent", mgr.status(2)
        mgr.save(3, _state(3))   # the manager goes on
        assert mgr.status(3).local == "committed"


def test_a_load_that_fails_on_every_tier_names_what_its_earlier_tries_filled(tmp_path):
    """The local copy damaged in 'b', the remote copy in 'a': the first (local) try fills 'a',
    the retries from the remote tier fail on 'a', and the error said filled=[] while 'a' held
    verified bytes of the save (a re-trial). The error now names what every try left."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    g = torch.Generator().manual_seed(1)
    sd = {"a": torch.randn(1 << 20, generator=g), "b": torch.randn(1 << 20, generator=g), "step": 1}
    with TieredCheckpointManager(local, remote, keep_last_local=3) as mgr:
        mgr.save(1, sd)
        mgr.wait_durable(1, timeout=60)
    from distckpt.restore import load_manifest
    for root, key in ((local, "b"), (remote, "a")):
        chunk = load_manifest(str(root / "step_00000001")).tensors[key].chunks[0]
        path = root / "step_00000001" / "rank00000.bin"
        raw = bytearray(path.read_bytes())
        raw[chunk.offset + chunk.nbytes - 100] ^= 1
        path.write_bytes(bytes(raw))
    out = {"a": torch.full((1 << 20,), -7.0), "b": torch.full((1 << 20,), -7.0), "step": -7}
    with TieredCheckpointManager(local, remote, keep_last_local=3) as mgr:
        with pytest.raises(errors.ChecksumMismatchError) as info:
            mgr.load(out, step=1)
    filled, partly = info.value.filled, info.value.partly_filled
    for key in ("a", "b"):
        if key in filled:
            assert torch.equal(out[key], sd[key]), key
        elif key not in partly:
            assert bool((out[key] == -7).all()), (key, filled, partly)
    assert "a" in filled, (filled, partly)   # the first, local try filled it
