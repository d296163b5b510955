"""Errors that point the right way: the true cause and a remedy that works, for the mistakes a new
user makes first (each was reported with a misleading message before)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

import distckpt
from distckpt import errors
from distckpt.storage.posix import locate
from distckpt.storage.posix.leftovers import TMP_RE


def _load_read_inspect(path) -> list[BaseException]:
    """The error each of load, read and `distckpt inspect` gives for ``path`` (inspect: its stderr)."""
    out = []
    for call in (lambda: distckpt.load({"w": torch.zeros(3)}, path), lambda: distckpt.read(path)):
        with pytest.raises(errors.DistCkptError) as info:
            call()
        out.append(info.value)
    proc = subprocess.run([sys.executable, "-m", "distckpt", "inspect", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    out.append(proc.stderr)
    return out


def _not_damaged(text: str) -> None:
    assert "never finished" not in text and "damaged" not in text and "older checkpoint" not in text


def test_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    for e in _load_read_inspect(tmp_path / "empty"):
        assert "empty directory: no checkpoint was ever saved here" in str(e)
        _not_damaged(str(e))
        if isinstance(e, BaseException):
            assert isinstance(e, errors.CheckpointNotFoundError)


def test_manager_root_names_its_steps(tmp_path):
    mgr = distckpt.CheckpointManager(tmp_path / "root")
    mgr.save(5, {"w": torch.ones(3)})
    mgr.save(12, {"w": torch.full((3,), 2.0)})
    for e in _load_read_inspect(tmp_path / "root"):
        text = str(e)
        assert "CheckpointManager root" in text and "step_00000005, step_00000012" in text
        assert os.path.join(str(tmp_path / "root"), "step_00000012") in text  # the remedy's path works:
        _not_damaged(text)
    newest = os.path.join(tmp_path / "root", "step_00000012")
    assert torch.equal(distckpt.read(newest)["w"], torch.full((3,), 2.0))


def test_torch_save_file(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "model.pt")
    for e in _load_read_inspect(tmp_path / "model.pt"):
        assert "is a torch.save file, not a distckpt checkpoint" in str(e)
        assert "torch.load(" in str(e) and "weights_only=True" in str(e)
        _not_damaged(str(e))
    # the remedy works
    assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=True)["w"], torch.ones(3))
    # a directory of torch.save files says so too
    (tmp_path / "d").mkdir()
    torch.save({}, tmp_path / "d" / "weights.pt")
    with pytest.raises(errors.CheckpointNotFoundError, match="weights.pt looks like a torch.save file"):
        distckpt.read(tmp_path / "d")


def test_data_files_without_manifest_is_the_unfinished_case(tmp_path):
    distckpt.save({"w": torch.ones(3)}, tmp_path / "ck")
    os.unlink(tmp_path / "ck" / "MANIFEST")
    with pytest.raises(errors.CheckpointIncompleteError, match="holds data files but no MANIFEST"):
        distckpt.read(tmp_path / "ck")


def test_path_inside_a_regular_file(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(errors.StorageError) as info:
        distckpt.save({"w": torch.ones(3)}, tmp_path / "f" / "ck")
    text = str(info.value)
    assert info.value.errno in (20, 17)  # ENOTDIR (or EEXIST from mkdir -p on the file)
    assert f"{tmp_path / 'f'} " in text and "is a file" in text
    assert "health" not in text
    with pytest.raises(errors.StorageError, match="is a file, not a directory") as info:
        distckpt.save({"w": torch.ones(3)}, tmp_path / "f" / "a" / "b")
    assert "health" not in str(info.value)
    with pytest.raises(errors.CheckpointNotFoundError, match=f"{tmp_path / 'f'} is a file, not a directory"):
        distckpt.read(tmp_path / "f" / "ck")
    e = errors.from_os_error(NotADirectoryError(20, "Not a directory"), path=str(tmp_path / "f" / "x" / "y"),
                             operation="open")
    assert f"{tmp_path / 'f'} is a file" in str(e) and "health" not in e.remedy


def test_saving_to_proc_is_not_disk_full():
    with pytest.raises(errors.StorageError) as info:
        distckpt.save({"w": torch.ones(3)}, "/proc/distckpt-test-ck")
    assert not isinstance(info.value, errors.DiskFullError)
    assert "pseudo file system" in str(info.value) and "Free" not in info.value.remedy
    with pytest.raises(errors.StorageError) as info:
        distckpt.CheckpointManager("/proc/distckpt-test-root")
    assert not isinstance(info.value, errors.DiskFullError) and "health" not in info.value.remedy
    report = distckpt.preflight("/proc/distckpt-test-ck", expected_bytes=1 << 20)
    disk = [c for c in report.checks if c.name == "disk"][0]
    assert "pseudo file system" in disk.message


def test_read_with_a_mistyped_key(tmp_path):
    distckpt.save({"model": {"weight": torch.ones(2)}, "step": 3}, tmp_path / "ck")
    with pytest.raises(errors.StateDictMismatchError) as info:
        distckpt.read(tmp_path / "ck", keys=["modle"])
    e = info.value
    assert "strict" not in str(e)  # read() takes no strict argument
    assert "did you mean 'model'" in str(e) and e.missing == ["modle"]
    with pytest.raises(KeyError):  # still a KeyError for callers
        distckpt.read(tmp_path / "ck", keys=["model.wieght"])
    # the suggestion works
    assert torch.equal(distckpt.read(tmp_path / "ck", keys=["model"])["model"]["weight"], torch.ones(2))


def test_a_tensor_as_the_whole_state_dict(tmp_path):
    t = torch.ones(3)
    with pytest.raises(errors.UnsupportedValueError, match="the state dict is a torch.Tensor") as info:
        distckpt.save(t, tmp_path / "bare")
    assert "{'weight': t}" in info.value.remedy and not (tmp_path / "bare").exists()
    distckpt.save({"weight": t}, tmp_path / "ck")
    with pytest.raises(errors.UnsupportedValueError, match="the state dict is a torch.Tensor") as info:
        distckpt.load(torch.zeros(3), tmp_path / "ck")
    assert "['']" not in str(info.value)
    out = {"weight": torch.zeros(3)}  # the remedy works
    distckpt.load(out, tmp_path / "ck")
    assert torch.equal(out["weight"], t)


def test_locate_agrees_with_the_save_protocol():
    assert locate.TMP_RE.pattern == TMP_RE.pattern


# --------------------------------------------------------------------------------------------
# Warnings from distckpt's own lines (the TorchRec example printed one FutureWarning per
# ShardedTensor access: shape and dtype went through ShardedTensor's deprecated __torch_function__).


def _sharded_tensor_warnings(rank, world_size, path):
    import warnings

    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    from distckpt.integrations import torchrec as dtr

    def st(values):
        return init_from_local_shards([Shard(values, ShardMetadata([0, 0], [4, 2], "rank:0/cpu"))], [4, 2])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distckpt.save({"st": st(torch.arange(8.0).reshape(4, 2))}, path)
        out = {"st": st(torch.zeros(4, 2))}
        distckpt.load(out, path)
        assert torch.equal(out["st"].local_shards()[0].tensor, torch.arange(8.0).reshape(4, 2))
        value = st(torch.zeros(4, 2))
        assert dtr._gshape(value) == (4, 2) and dtr._gdtype(value) == torch.float32
    ours = os.path.dirname(distckpt.__file__)
    return [f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught
            if w.filename.startswith(ours)]


def test_no_warnings_from_our_lines_with_sharded_tensors(tmp_path):
    from ..helpers.distributed import run_ranks

    (ours,) = run_ranks(_sharded_tensor_warnings, 1, str(tmp_path / "ck"))
    assert ours == []


def test_a_collective_failure_names_each_ranks_class_and_one_remedy_each():
    """One rank's state_dict() raised RuntimeError, another's disk was full: the message read
    "rank 1: DistCkptError: [rank 1] RuntimeError: ... Remedy: See docs/ERRORS.md ..." with a
    second "Remedy:" after it. Each rank's cause now reads as its own class and message, and the
    typed failures' remedies follow the collective one, once each."""
    from distckpt._dist import _portable
    failures = {1: _portable(RuntimeError("boom in state_dict")),
                0: errors.DiskFullError("disk full", path="/x", rank=0)}
    err = errors.RankFailureError(failures, operation="save", rank=0)
    text = str(err)
    assert "rank 0: DiskFullError: disk full; rank 1: RuntimeError: boom in state_dict." in text
    assert text.count("Remedy:") == 1 and "[rank 1]" not in text and "DistCkptError" not in text
    assert "Rank 0 (DiskFullError): Free space" in err.remedy



@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "directory"])
def test_a_save_lock_name_taken_by_something_else_says_what_is_in_the_way(tmp_path, kind):
    """A symlink (followed nowhere) or a directory at a manager root's lock name: the error said
    "[Errno 40] Too many levels of symbolic links ... Check the file system's health"."""
    mgr = distckpt.CheckpointManager(str(tmp_path / "root"))
    mgr.save(1, {"w": torch.ones(2)}, no_dist=True)
    lock = tmp_path / "root" / ".distckpt.lock"
    if lock.exists():
        lock.unlink()
    target = tmp_path / "target"
    target.write_text("keep me")
    if kind == "directory":
        lock.mkdir()
    else:
        os.symlink(target if kind == "symlink" else tmp_path / "nowhere", lock)
    with pytest.raises(errors.StorageError) as info:
        mgr.save(2, {"w": torch.ones(2)}, no_dist=True)
    word = "a directory" if kind == "directory" else "a symbolic link"
    assert f"is {word}" in info.value.message and "health" not in info.value.remedy
    assert str(lock) in info.value.remedy and target.read_text() == "keep me"
    assert mgr.steps() == [1]


def test_a_symlink_loop_above_a_save_lock_is_not_called_the_lock(tmp_path):
    """ELOOP from a loop in a parent directory: the lock is not "a symbolic link" to remove (it
    does not exist); the error names the path's problem instead."""
    from distckpt.storage.posix import savelock

    os.symlink(tmp_path / "loop", tmp_path / "loop")
    lock = tmp_path / "loop" / ".x.lock"
    with pytest.raises(errors.StorageError) as info:
        savelock.acquire(str(lock), save_id="0" * 32, what=str(tmp_path / "loop" / "x"))
    assert info.value.errno == errno.ELOOP and "is a symbolic link, not" not in info.value.message
    assert f"Remove {lock}" not in (info.value.remedy or ""), info.value.remedy


def test_object_min_rate_takes_binary_units_like_every_size_variable(monkeypatch):
    """README: sizes in DISTCKPT_* variables use binary units; DISTCKPT_OBJECT_MIN_RATE=64K was
    "not a number" (an outside trial). A decimal suffix says what to write instead."""
    from distckpt.storage.object.request import request_timeout

    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "10")
    monkeypatch.setenv("DISTCKPT_OBJECT_MIN_RATE", "64K")
    assert request_timeout(64 << 10) == 11.0
    monkeypatch.setenv("DISTCKPT_OBJECT_MIN_RATE", "4194304")
    assert request_timeout(4 << 20) == 11.0
    monkeypatch.setenv("DISTCKPT_OBJECT_MIN_RATE", "64KB")
    with pytest.raises(errors.ConfigError, match="ambiguous"):
        request_timeout(1)
    monkeypatch.setenv("DISTCKPT_OBJECT_MIN_RATE", "1K")
    with pytest.raises(errors.ConfigError, match="between"):
        request_timeout(1)


def test_object_min_rate_still_takes_the_plain_numbers_it_took_before(monkeypatch):
    """Taking sizes refused the plain numbers the variable took before (``4194304.0``, ``4e6``:
    a job's existing config), and a value of more digits than a float holds escaped as a bare
    OverflowError from the size parser."""
    from distckpt.sizes import parse_size
    from distckpt.storage.object.request import request_timeout

    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "10")
    for raw in ("4194304.0", "4.194304e6"):
        monkeypatch.setenv("DISTCKPT_OBJECT_MIN_RATE", raw)
        assert request_timeout(4 << 20) == 11.0, raw
    monkeypatch.setenv("DISTCKPT_OBJECT_MIN_RATE", "inf")
    with pytest.raises(errors.ConfigError):
        request_timeout(1)
    huge = "1" + "0" * 400 + ".5K"
    with pytest.raises(ValueError, match="too large"):
        parse_size(huge)
    monkeypatch.setenv("DISTCKPT_OBJECT_MIN_RATE", huge)
    with pytest.raises(errors.ConfigError, match="too large"):
        request_timeout(1)
