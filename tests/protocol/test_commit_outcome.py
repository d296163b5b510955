"""A collective save whose peer dies after the commit point must say that it committed.

Rank 1 is killed (os._exit, no word to anyone) right after its WRITE report reached rank 0: rank 0
has every record, commits step 2 and rotates step 1 away, and only then loses rank 1 when it
broadcasts the verdict. The truthful outcome is CommittedButPeerLostError (a PeerLostError, so
existing handlers still catch it) with ``committed`` and ``path``; never a plain "save failed".
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from ..helpers.distributed import RankError, run_ranks


def _wait_dead(pid: int, timeout: float = 30.0) -> None:
    """Until ``pid`` has exited (a zombie counts: its sockets are closed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)
    raise AssertionError(f"rank 1 (pid {pid}) did not die")


def _die_after_write_report() -> None:
    """Make this rank exit (os._exit, no word to anyone) right after it has sent its WRITE report
    (records and file size) to rank 0: WRITE's message is a WriteOutcome."""
    from distckpt._dist import ControlGroup
    from distckpt.commit import WriteOutcome
    real = ControlGroup.gather

    def gather(self, obj, dst=0):
        out = real(self, obj, dst)
        if isinstance(obj, WriteOutcome):
            os._exit(3)
        return out

    ControlGroup.gather = gather


def _body(rank, world, root):
    import distckpt
    from distckpt import errors
    from distckpt._dist import ControlGroup

    mgr = distckpt.CheckpointManager(root, keep_last=1)
    state = {"x": torch.full((1000,), 7.0), "y": torch.arange(10)}  # replicas: one writer each
    mgr.save(1, state)
    pidfile = os.path.join(root, "..", "rank1.pid")
    if rank == 1:
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
        _die_after_write_report()  # rank 1's records are on rank 0 now
    else:
        real_broadcast = ControlGroup.broadcast
        seen = []

        def broadcast(self, obj, src=0):
            seen.append(1)
            if len(seen) == 2:  # PREPARE, then the COMMIT verdict: let rank 1 be gone for sure
                with open(pidfile) as f:
                    _wait_dead(int(f.read()))
            return real_broadcast(self, obj, src)

        ControlGroup.broadcast = broadcast
    try:
        mgr.save(2, state)
        out = {"type": None}
    except errors.PeerLostError as exc:
        out = {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
               "committed": getattr(exc, "committed", None), "path": exc.path,
               "lost_ranks": getattr(exc, "lost_ranks", None), "message": str(exc)}
    out["steps"] = mgr.steps()
    with open(os.path.join(root, "..", "rank0.json"), "w") as f:  # run_ranks drops rank 0's result
        json.dump(out, f)                                          # when rank 1 dies
    return out


def test_peer_lost_after_commit_is_reported_as_committed(tmp_path):
    root = str(tmp_path / "root")
    with pytest.raises(RankError) as ei:
        run_ranks(_body, 2, root, env={"DISTCKPT_TIMEOUT_S": "20"}, timeout=120)
    assert set(ei.value.errors) == {1}, ei.value  # only the killed rank is missing
    with open(tmp_path / "rank0.json") as f:
        out = json.load(f)
    assert out["steps"] == [2], out  # committed, and step 1 rotated away
    assert out["type"] == "CommittedButPeerLostError", out
    assert "PeerLostError" in out["mro"]
    assert out["committed"] is True and out["path"] == os.path.join(root, "step_00000002")
    assert out["lost_ranks"] == [1], out
    assert "is committed" in out["message"] and "rank 1" in out["message"], out["message"]
    # The checkpoint it reports as committed loads, complete.
    import distckpt
    got = distckpt.read(out["path"])
    assert torch.equal(got["x"], torch.full((1000,), 7.0)) and torch.equal(got["y"], torch.arange(10))


def _rank0_dies_body(rank, world, root, when):
    import distckpt
    from distckpt import errors
    from distckpt.storage.posix import commit as local

    path = os.path.join(root, "ckpt")
    if rank == 0:
        real_publish = local.publish_dir

        def publish_dir(tmp_dir, final_dir, *, overwrite):
            if when == "before_rename":
                os._exit(3)  # MANIFEST is written in the tmp dir, the rename never happens
            out = real_publish(tmp_dir, final_dir, overwrite=overwrite)
            os._exit(3)      # renamed and fsynced: committed, and nobody hears the verdict
            return out

        local.publish_dir = publish_dir
    try:
        distckpt.save({"x": torch.full((1000,), 7.0)}, path)
        out = {"type": None}
    except errors.PeerLostError as exc:
        out = {"type": type(exc).__name__, "committed": getattr(exc, "committed", "unset"),
               "path": exc.path, "lost_ranks": getattr(exc, "lost_ranks", None),
               "save_id": getattr(exc, "save_id", None), "message": str(exc)}
    with open(os.path.join(root, "rank1.json"), "w") as f:
        json.dump(out, f)
    return out


@pytest.mark.parametrize("when", ["after_rename", "before_rename"])
def test_other_ranks_report_what_they_can_know(tmp_path, when):
    """Rank 0 dies right after (or right before) the rename: rank 1 finds this save's MANIFEST on
    the shared file system and says committed, or says it cannot tell; never "nothing committed"."""
    root = str(tmp_path)
    with pytest.raises(RankError) as ei:
        run_ranks(_rank0_dies_body, 2, root, when, env={"DISTCKPT_TIMEOUT_S": "20"}, timeout=120)
    assert set(ei.value.errors) == {0}, ei.value
    with open(tmp_path / "rank1.json") as f:
        out = json.load(f)
    path = os.path.join(root, "ckpt")
    if when == "after_rename":
        assert out["type"] == "CommittedButPeerLostError", out
        assert out["committed"] is True and out["path"] == path and out["lost_ranks"] == [0]
        import distckpt
        assert torch.equal(distckpt.read(path)["x"], torch.full((1000,), 7.0))
    else:
        assert out["type"] == "PeerLostError", out
        assert out["committed"] is None and out["path"] == path and len(out["save_id"]) == 32
        assert "cannot tell whether the checkpoint was committed" in out["message"]
        assert not os.path.exists(path)


def test_after_commit_error_says_committed(tmp_path):
    """The manager's ``latest`` / rotation step fails after the rename: the error is raised, and
    carries ``committed = True``; the checkpoint loads."""
    import distckpt
    from distckpt import errors
    from distckpt.save_sync import save_in_root

    def rotation_fails():
        raise errors.StoragePermissionError("delete failed: [Errno 13] Permission denied", errno=13,
                                            path=str(tmp_path / "old"))

    path = str(tmp_path / "c")
    with pytest.raises(errors.StoragePermissionError) as ei:
        save_in_root({"x": torch.ones(10)}, path, after_commit=rotation_fails)
    assert ei.value.committed is True
    assert torch.equal(distckpt.read(path)["x"], torch.ones(10))


def _resume_body(rank, world, root):
    """The manager's resumed-from protection ends on every rank, and only when a save started
    after the load commits (async saves settle on their own thread; a newer load survives)."""
    import threading

    import distckpt
    from distckpt import errors

    mgr = distckpt.CheckpointManager(root, keep_last=2)
    seen = {}
    mgr.save(1, {"x": torch.ones(4)})
    mgr.save(2, {"x": torch.ones(4)})
    mgr.load({"x": torch.empty(4)}, step=1)
    seen["after_load"] = mgr._resumed_from
    # 1. An async save completes: every rank ends the protection (before: rank 0 only, in its hook).
    mgr.save(3, {"x": torch.ones(4)}, blocking=False).result()
    seen["after_async"] = mgr._resumed_from
    # 2. A load while an async save is in flight: rank 0's commit waits until that load is done;
    #    the save that started before the load must not end the newer load's protection.
    gate = threading.Event()
    real_after = mgr._after_commit

    def slow_after(step, protect, rotate=True, **kw):
        assert gate.wait(60), "the load never finished"
        real_after(step, protect, rotate, **kw)

    mgr._after_commit = slow_after
    h = mgr.save(4, {"x": torch.ones(4)}, blocking=False)
    mgr.load({"x": torch.empty(4)}, step=2)
    gate.set()
    h.result()
    seen["load_during_async"] = mgr._resumed_from
    # 3. A blocking save whose hook fails after the commit (committed = True on every rank).
    def failing_after(step, protect, rotate=True, **kw):
        real_after(step, protect, rotate, **kw)
        raise errors.StoragePermissionError("rotation failed: [Errno 13] Permission denied", errno=13, path=root)

    mgr._after_commit = failing_after
    try:
        mgr.save(5, {"x": torch.ones(4)})
        seen["committed_error"] = "no error"
    except errors.DistCkptError as exc:
        seen["committed_error"] = [type(exc).__name__, getattr(exc, "committed", None), mgr._resumed_from]
    # 4. An uncommitted save keeps the protection.
    mgr._after_commit = real_after
    mgr.load({"x": torch.empty(4)}, step=5)
    try:
        mgr.save(6, {"x": object()})  # not saveable without allow_pickle: fails in PLAN
    except errors.DistCkptError as exc:
        seen["failed_save"] = [type(exc).__name__, mgr._resumed_from]
    mgr.close()
    return seen


def test_manager_resume_protection_settles_on_every_rank(tmp_path):
    results = run_ranks(_resume_body, 2, str(tmp_path / "root"), timeout=180)
    for rank, seen in enumerate(results):
        assert seen["after_load"] == 1, (rank, seen)
        assert seen["after_async"] is None, (rank, seen)
        assert seen["load_during_async"] == 2, (rank, seen)
        assert seen["committed_error"][1] is True and seen["committed_error"][2] is None, (rank, seen)
        assert seen["failed_save"][1] == 5, (rank, seen)


def _published_unsynced_body(rank, world, root):
    import distckpt
    from distckpt import errors
    from distckpt.storage.posix import commit as local

    path = os.path.join(root, "ckpt")
    pidfile = os.path.join(root, "rank1.pid")
    if rank == 1:
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
        _die_after_write_report()  # rank 0 has the records
    else:
        real_publish = local.publish_dir

        def publish_dir(tmp_dir, final_dir, *, overwrite):
            real_publish(tmp_dir, final_dir, overwrite=overwrite)
            with open(pidfile) as f:
                _wait_dead(int(f.read()))
            # What publish_dir raises when the parent's fsync fails and the rename cannot be undone.
            exc = errors.StorageIOError("fsync of the parent failed: [Errno 5] Input/output error", errno=5,
                                        path=root)
            exc.published = True
            raise exc

        local.publish_dir = publish_dir
    try:
        distckpt.save({"x": torch.full((1000,), 7.0)}, path)
        out = {"type": None}
    except errors.PeerLostError as exc:
        after = getattr(exc, "after_commit_error", None)
        out = {"type": type(exc).__name__, "committed": getattr(exc, "committed", "unset"),
               "after": type(after).__name__ if after is not None else None, "message": str(exc)}
    with open(os.path.join(root, "rank0.json"), "w") as f:
        json.dump(out, f)
    return out


def test_peer_lost_after_unsynced_publish_says_so(tmp_path):
    """The rename happened but the parent's fsync failed (the checkpoint is visible, maybe not
    durable), then the peer is lost: neither "committed" nor "nothing committed"."""
    root = str(tmp_path)
    with pytest.raises(RankError) as ei:
        run_ranks(_published_unsynced_body, 2, root, env={"DISTCKPT_TIMEOUT_S": "20"}, timeout=120)
    assert set(ei.value.errors) == {1}, ei.value
    with open(tmp_path / "rank0.json") as f:
        out = json.load(f)
    assert out["type"] == "PeerLostError" and out["committed"] is None, out
    assert out["after"] == "StorageIOError" and "published" in out["message"], out
