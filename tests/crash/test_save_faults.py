"""Real OS faults at the level of distckpt.save / CheckpointManager.save / load (issue #4).

Every test provokes a real kernel error (a full tmpfs or loop-mounted ext4, exhausted inodes, a
read-only mount, rlimits, dropped capabilities, a seccomp filter, or strace's syscall fault
injection) during a whole save or load, and then holds the same promises (docs/DESIGN.md I1-I7):

  * the error is the documented typed class, keeps errno, and carries path, rank and a remedy;
  * no fd the library opened is still open (/proc/self/fd compared before and after);
  * nothing was committed: no new step directory, no tmp/del directory left behind;
  * the previous checkpoint is still there and loads bit-exact;
  * the process was not killed (SIGBUS, SIGXFSZ) and nothing hung (every child has a timeout).

Tests that need root, a tool (strace, mkfs.ext4) or x86_64 (the seccomp filter) skip with the
reason. Children (rlimits, capabilities, seccomp, strace) each run several cases to stay cheap.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import resource
import shutil
import subprocess
import time

import pytest
import torch

import distckpt
import distckpt.storage.posix.saving  # noqa: F401 - patched below (where PREPARE checks space)
from distckpt import errors as E
from distckpt.storage.posix.leftovers import TMP_RE
from distckpt.storage.posix import reset_choices

from ..helpers import seccomp as _seccomp
from ..conftest import open_fds
from ..helpers.distributed import run_ranks
from ..helpers.faults import (PYTHON, REPO_ROOT, ext4_image_mount, fill_inodes, fill_space, readonly_mount,
                     require_root, require_tools, run_python, tmpfs_mount)

BACKENDS = ("uring", "pwrite", "buffered")
MiB = 1 << 20


# ------------------------------------------------------------------------------------------------
# Shared helpers


def _prev_state() -> dict:
    g = torch.Generator().manual_seed(1234)
    return {"model": {"w": torch.randn(256, 64, generator=g),
                      "b": torch.randn(77, generator=g).to(torch.bfloat16)},
            "step": 1, "note": "previous"}


def _big_state(nbytes: int) -> dict:
    return {"model": {"w": torch.full((nbytes // 4,), 1.5), "b": torch.zeros(77, dtype=torch.bfloat16)},
            "step": 2, "note": "new"}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                            b.reshape(-1).contiguous().view(torch.uint8)))


def _reset(monkeypatch, **env: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from distckpt.config import get_config
    get_config.cache_clear()
    reset_choices()


def _assert_prev_intact(root: str, name: str = "step_1") -> None:
    """The previous checkpoint is still committed and loads bit-exact (read and load)."""
    want = _prev_state()
    path = os.path.join(root, name)
    got = distckpt.read(path)
    assert _same_bytes(got["model"]["w"], want["model"]["w"])
    assert _same_bytes(got["model"]["b"], want["model"]["b"])
    assert got["step"] == 1 and got["note"] == "previous"
    into = {"model": {"w": torch.zeros(256, 64), "b": torch.zeros(77, dtype=torch.bfloat16)},
            "step": 0, "note": ""}
    distckpt.load(into, path)
    assert _same_bytes(into["model"]["w"], want["model"]["w"]) and into["step"] == 1


def _assert_nothing_committed(root: str, failed: str = "step_2", allowed=("step_1", "lost+found", "latest")) -> None:
    """No new step, no tmp/del leftover, nothing loadable under the failed name."""
    names = sorted(os.listdir(root))
    leftovers = [n for n in names if TMP_RE.match(n) or n.startswith(".latest.tmp-")]
    assert not leftovers, f"tmp leftovers after a failed save: {leftovers}"
    assert set(names) <= set(allowed), f"unexpected entries in {root}: {names}"
    with pytest.raises(E.CheckpointNotFoundError):
        distckpt.read(os.path.join(root, failed))


def _space_op(backend: str) -> tuple[str, ...]:
    """Where a save that does not fit fails: the O_DIRECT backends preallocate the rank file from
    the plan's size (one fallocate, before any data is written); buffered finds out in write()."""
    return {"buffered": ("write",), "auto": ("fallocate", "write")}.get(backend, ("fallocate",))


def _assert_typed(exc, cls: type, code: int | None, *, operation: str | tuple | None = None) -> None:
    """Class, errno and the fields every typed error must carry (path, rank, remedy)."""
    assert isinstance(exc, cls), f"{type(exc).__name__} is not {cls.__name__}: {exc}"
    assert isinstance(exc, E.DistCkptError) and isinstance(exc, Exception)
    if code is not None:
        assert isinstance(exc, OSError) and exc.errno == code, (exc.errno, code, str(exc))
    assert exc.path, f"no path on {exc!r}"
    assert exc.rank is not None, f"no rank on {exc!r}"
    assert exc.remedy and exc.remedy.strip(), f"no remedy on {exc!r}"
    if operation is not None:
        ops = (operation,) if isinstance(operation, str) else operation
        assert exc.details.get("operation") in ops, (exc.details, ops)
    assert "Remedy:" in str(exc)


def _assert_typed_dict(err: dict, cls_name: str, code: int | None, *, operation: str | tuple | None = None) -> None:
    """Like _assert_typed for an error a child reported with error_dict()."""
    assert err is not None, "child raised no error"
    assert cls_name in err["mro"], f"{err['type']} is not {cls_name}: {err['message']}"
    assert "DistCkptError" in err["mro"] and "Exception" in err["mro"]
    if code is not None:
        assert "OSError" in err["mro"] and err["errno"] == code, err
    assert err["path"], err
    assert err["rank"] is not None, err
    assert err["remedy"], err
    if operation is not None:
        ops = (operation,) if isinstance(operation, str) else operation
        assert err["fields"].get("operation") in ops, (err, ops)


def _save_prev(root: str) -> None:
    distckpt.save(_prev_state(), os.path.join(root, "step_1"))


# A child: attempt(path, state) runs one save and reports the error, the fds it left open and the
# directory listing, so the parent can check every promise.
_CHILD_COMMON = """
import os, sys, signal
import torch, distckpt
from distckpt.storage.posix import reset_choices
from distckpt.config import get_config
from tests.conftest import highest_fd, open_fds

def big_state(nbytes):
    return {"model": {"w": torch.full((nbytes // 4,), 1.5), "b": torch.zeros(77, dtype=torch.bfloat16)},
            "step": 2, "note": "new"}

def attempt(path, state, fn=None, reset=True):
    if reset:
        fresh()
    before = open_fds()
    out = {"path": path}
    try:
        r = (fn or distckpt.save)(state, path)
        out["ok"] = {"backend": getattr(r, "backend", None), "reason": getattr(r, "backend_reason", None)}
    except Exception as exc:
        out["error"] = error_dict(exc)
    after = open_fds()
    out["leaked_fds"] = {str(k): v for k, v in after.items() if before.get(k) != v}
    out["listing"] = sorted(os.listdir(os.path.dirname(path)))
    return out

def fresh(**env):
    os.environ.update(env)
    get_config.cache_clear()
    reset_choices()
"""


def _child_code(body: str, **params) -> str:
    """_CHILD_COMMON, then one ``name = repr(value)`` line per parameter, then ``body``."""
    return _CHILD_COMMON + "".join(f"{k} = {v!r}\n" for k, v in params.items()) + body


def _child_checks(out: dict, root: str) -> None:
    assert not out["leaked_fds"], f"fds left open by the library: {out['leaked_fds']}"
    bad = [n for n in out["listing"] if TMP_RE.match(n)]
    assert not bad, f"tmp leftovers: {bad}"


def _need_strace() -> None:
    require_tools("strace")
    probe = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=fsync",
                            "-e", "inject=fsync:error=EIO", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace/inject here (ptrace refused?): {probe.stderr.strip()}")


def _strace_python(code: str, inject: list[str], *, env: dict | None = None, timeout: float = 90,
                   only_paths: list[str] = ()):
    """Run ``code`` (with faults' emit()/error_dict()) in the real interpreter under strace fault
    injection. Only the injected syscalls are traced (--seccomp-bpf keeps the rest at full speed);
    ``only_paths`` (strace -P) limits the injection to syscalls on those files."""
    from ..helpers.faults import _MARK, _PRELUDE
    import json
    import textwrap
    traced = sorted({spec.split(":")[0].split("=")[1] for spec in inject})
    argv = ["strace", "-f", "--seccomp-bpf", "-qq", "-o", "/dev/null", "-e", "trace=" + ",".join(traced)]
    for spec in inject:
        argv += ["-e", spec]
    for p in only_paths:
        argv += ["-P", p]
    argv += [PYTHON, "-c", _PRELUDE + textwrap.dedent(code)]
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + child_env.get("PYTHONPATH", "")
    child_env.update(env or {})
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_env,
                              cwd=str(REPO_ROOT))
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"strace child hung past {timeout} s: {exc.stderr}") from None
    assert proc.returncode == 0, f"child exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    emitted = [json.loads(line[len(_MARK):]) for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    assert emitted, proc.stdout + proc.stderr
    return emitted[-1]


# ------------------------------------------------------------------------------------------------
# ENOSPC during the data write (pre-flight off: the write path itself), every backend


@pytest.mark.root
@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_enospc_during_data_write(tmp_path, monkeypatch, fs, backend):
    """Pre-flight off, 40 MiB into a ~16-20 MiB file system. uring/pwrite preallocate the rank
    file from the plan's size, so ENOSPC comes from that fallocate before any data is written;
    buffered finds it in write(). Either way: typed, fds closed, tmp dir gone, space back."""
    _reset(monkeypatch, DISTCKPT_IO_BACKEND=backend, DISTCKPT_PREFLIGHT="0",
           DISTCKPT_BLOCK_SIZE=str(256 << 10))
    mnt = tmp_path / "m"
    cm = tmpfs_mount(mnt, "16m") if fs == "tmpfs" else ext4_image_mount(mnt, "24m")
    with cm as d:
        root = str(d)
        _save_prev(root)
        used_before = os.statvfs(root).f_bfree
        before = open_fds()
        with pytest.raises(E.DiskFullError) as ei:
            distckpt.save(_big_state(40 * MiB), os.path.join(root, "step_2"))
        assert open_fds() == before
        _assert_typed(ei.value, E.DiskFullError, errno.ENOSPC, operation=_space_op(backend))
        assert os.path.basename(ei.value.path) == "rank00000.bin"
        assert ei.value.free is not None  # the numbers at the time of the failure
        _assert_nothing_committed(root)
        # The partial data file went with the tmp dir: the space is back (1 MiB of slack for
        # metadata blocks the file system may still be settling).
        st = os.statvfs(root)
        assert st.f_bfree >= used_before - MiB // st.f_frsize, (st.f_bfree, used_before)
        _assert_prev_intact(root)


# ------------------------------------------------------------------------------------------------
# Pre-flight on: refuse before a byte is written, with the numbers


@pytest.mark.root
@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
def test_preflight_refuses_before_writing(tmp_path, monkeypatch, fs):
    _reset(monkeypatch, DISTCKPT_PREFLIGHT="1")
    mnt = tmp_path / "m"
    cm = tmpfs_mount(mnt, "16m") if fs == "tmpfs" else ext4_image_mount(mnt, "24m")
    with cm as d:
        root = str(d)
        _save_prev(root)
        st0 = os.statvfs(root)
        listing0 = sorted(os.listdir(root))
        before = open_fds()
        with pytest.raises(E.DiskFullError) as ei:
            distckpt.save(_big_state(40 * MiB), os.path.join(root, "step_2"))
        assert open_fds() == before
        e = ei.value
        _assert_typed(e, E.DiskFullError, errno.ENOSPC)
        assert e.needed > 40 * MiB and 0 <= e.free < e.needed
        assert e.fstype == fs and os.path.realpath(e.mount_point) == os.path.realpath(root)
        assert re.search(rf"needs [\d.]+ [KMG]iB on {re.escape(e.mount_point)} \({fs}\), [\d.]+ (?:[KMG]i)?B free",
                         e.message), e.message
        # Nothing was written: not a block, not an inode, not a tmp dir.
        st1 = os.statvfs(root)
        assert (st1.f_bfree, st1.f_ffree) == (st0.f_bfree, st0.f_ffree)
        assert sorted(os.listdir(root)) == listing0
        _assert_nothing_committed(root)
        _assert_prev_intact(root)


@pytest.mark.root
@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
def test_space_vanishes_after_preflight_manager_save(tmp_path, monkeypatch, fs):
    """Pre-flight passes, then another process's file grows into the space: the real write gets
    ENOSPC. Through CheckpointManager.save: ``latest`` and the newest step stay the old ones."""
    _reset(monkeypatch, DISTCKPT_PREFLIGHT="1")
    mnt = tmp_path / "m"
    cm = tmpfs_mount(mnt, "32m") if fs == "tmpfs" else ext4_image_mount(mnt, "40m")
    with cm as d:
        root = str(d)
        mgr = distckpt.CheckpointManager(root, keep_last=1)
        mgr.save(1, _prev_state())
        filler_dir = os.path.join(root, "other-job")
        os.mkdir(filler_dir)
        real_check = distckpt.storage.posix.guards.check_save_space
        calls = []

        def check_then_fill(path, needed, **kw):
            real_check(path, needed, **kw)          # passes: the space is free now...
            calls.append(fill_space(filler_dir, leave_bytes=2 * MiB))  # ...and then it is not

        # Where a POSIX save's PREPARE calls its space guard (storage/posix/guards.py).
        monkeypatch.setattr(distckpt.storage.posix.saving, "check_save_space", check_then_fill)
        before = open_fds()
        with pytest.raises(E.DiskFullError) as ei:
            mgr.save(2, _big_state(12 * MiB))
        assert calls, "pre-flight did not run"
        assert open_fds() == before
        _assert_typed(ei.value, E.DiskFullError, errno.ENOSPC, operation=_space_op("auto"))
        shutil.rmtree(filler_dir)
        _assert_nothing_committed(root, failed="step_00000002", allowed=("step_00000001", "latest", "lost+found"))
        assert mgr.latest_step() == 1
        with open(os.path.join(root, "latest")) as f:
            assert f.read().strip() == "step_00000001"
        into = {"model": {"w": torch.zeros(256, 64), "b": torch.zeros(77, dtype=torch.bfloat16)},
                "step": 0, "note": ""}
        mgr.load(into)
        assert _same_bytes(into["model"]["w"], _prev_state()["model"]["w"])


# ------------------------------------------------------------------------------------------------
# Inode exhaustion


@pytest.mark.root
@pytest.mark.parametrize("free_inodes", [0, 1, 2, 3])
def test_inode_exhaustion(tmp_path, monkeypatch, free_inodes):
    """0 free: the save lock file fails; 1: mkdir of the tmp dir fails; 2: the data file fails;
    3: the MANIFEST fails (the
    backend choice is cached from the first save, so no probe file). Pre-flight off so the real
    creation is what fails."""
    _reset(monkeypatch, DISTCKPT_PREFLIGHT="0")
    # -N 32 leaves room for the previous checkpoint and the fillers' directory; the fillers then
    # take every inode but ``free_inodes``.
    with ext4_image_mount(tmp_path / "m", "8m", inodes=32) as d:
        root = str(d)
        _save_prev(root)
        fillers = os.path.join(root, "fillers")
        os.mkdir(fillers)
        n = fill_inodes(fillers)
        for i in range(free_inodes):
            os.unlink(os.path.join(fillers, f"inode-{n - 1 - i:07d}"))
        assert os.statvfs(root).f_favail == free_inodes
        before = open_fds()
        with pytest.raises(E.DiskFullError) as ei:
            distckpt.save(_big_state(64 << 10), os.path.join(root, "step_2"))
        assert open_fds() == before
        _assert_typed(ei.value, E.DiskFullError, errno.ENOSPC)
        assert ei.value.free_inodes == 0, ei.value.details
        failed_at = os.path.basename(ei.value.path)
        expect = {0: r"\.step_2\.lock", 1: r"\.step_2\.tmp-[0-9a-f]{32}", 2: "rank00000\\.bin",
                  3: "MANIFEST"}[free_inodes]
        assert re.fullmatch(expect, failed_at), (failed_at, ei.value.details)
        _assert_nothing_committed(root, allowed=("step_1", "lost+found", "fillers"))
        assert os.statvfs(root).f_favail == free_inodes  # the tmp dir's inodes came back
        _assert_prev_intact(root)


@pytest.mark.root
@pytest.mark.parametrize("free_inodes", [0, 3])
def test_inode_exhaustion_preflight(tmp_path, monkeypatch, free_inodes):
    """The pre-flight check wants the few inodes a save creates, not one (with 3 free the save
    failed later, at its data file), and its remedy says to free inodes (it read "Free on /m")."""
    _reset(monkeypatch, DISTCKPT_PREFLIGHT="1")
    with ext4_image_mount(tmp_path / "m", "8m", inodes=32) as d:
        root = str(d)
        _save_prev(root)
        fillers = os.path.join(root, "fillers")
        os.mkdir(fillers)
        n = fill_inodes(fillers)
        for i in range(free_inodes):
            os.unlink(os.path.join(fillers, f"inode-{n - 1 - i:07d}"))
        with pytest.raises(E.DiskFullError) as ei:
            distckpt.save(_big_state(64 << 10), os.path.join(root, "step_2"))
        _assert_typed(ei.value, E.DiskFullError, errno.ENOSPC)
        assert "inodes" in ei.value.message and ei.value.free_inodes <= free_inodes  # the lock took one
        assert "Free inodes (files) on" in ei.value.remedy, ei.value.remedy
        _assert_nothing_committed(root, allowed=("step_1", "lost+found", "fillers"))
        _assert_prev_intact(root)


@pytest.mark.root
def test_no_inode_remedy_where_the_file_system_counts_no_inodes(tmp_path):
    """tmpfs with nr_inodes=0 (like btrfs) reports f_files == f_favail == 0: an ENOSPC there is
    out of bytes, never "free inodes", and EDQUOT (a quota spent) says so, not "free inodes"
    (both read "it has bytes left but no inodes")."""
    with tmpfs_mount(tmp_path / "m", "4m", options=["nr_inodes=0"]) as d:
        assert os.statvfs(d).f_files == 0 and os.statvfs(d).f_bavail > 0
        enospc = E.from_os_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), path=str(d / "x"))
        assert isinstance(enospc, E.DiskFullError) and enospc.free_inodes is None, enospc.details
        assert "no inode limit" in enospc.message and "inodes" not in (enospc.remedy or ""), enospc.remedy
        edquot = E.from_os_error(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), path=str(d / "x"))
        assert isinstance(edquot, E.DiskFullError) and "quota" in edquot.remedy, edquot.remedy
        from distckpt.checks import filesystem
        report = filesystem.disk_check(d, 1 << 20)  # `distckpt preflight`'s disk check alike
        assert report.details["free_inodes"] is None and "no inode limit" in report.message, report.message


# ------------------------------------------------------------------------------------------------
# EIO / ENOSPC at fsync (strace fault injection on the real syscall)
#
# strace fails every STEP-th fsync of the child's main thread (where the writers and the commit
# call fsync). Before each save the child finds that phase with fsyncs of a scratch file (one
# fails: a failure position), then spends STEP - k more, so that exactly the k-th fsync of the
# save fails: k=1 the data file, 2 MANIFEST, 3 the tmp dir, 4 the parent after the rename. One
# child covers every case without hard-coding how many fsyncs anything else makes.

_FSYNC_STEP = 16

_FSYNC_CHILD = """
scratch = os.open(os.path.join(root, "scratch"), os.O_CREAT | os.O_WRONLY, 0o600)

def fails_at(k):
    for _ in range(4 * step):          # find a failure position
        try:
            os.fsync(scratch)
        except OSError:
            break
    else:
        raise SystemExit("no fsync failed: is strace injecting?")
    for _ in range(step - k):          # the next failure is then the save's k-th fsync
        os.fsync(scratch)

results = []
for i, (backend, k) in enumerate(cases):
    fresh(DISTCKPT_IO_BACKEND=backend)
    distckpt.storage.posix.choose_backend(root)   # probe now, not inside the counted save
    fails_at(k)
    out = attempt(os.path.join(root, f"step_{i + 2}"), big_state(3 << 20), reset=False)
    out["case"] = [backend, k]
    results.append(out)
os.close(scratch)
os.unlink(os.path.join(root, "scratch"))
emit(results)
"""


def _fsync_cases(code: int):
    if code == errno.EIO:
        return [(b, 1) for b in BACKENDS] + [("pwrite", 2), ("pwrite", 3), ("pwrite", 4)]
    return [("uring", 1), ("buffered", 2)]


@pytest.mark.root
@pytest.mark.parametrize("code,cls", [(errno.EIO, "StorageIOError"), (errno.ENOSPC, "DiskFullError")],
                         ids=["EIO", "ENOSPC"])
def test_fsync_error_fails_the_save(tmp_path, code, cls):
    """fsync fails on the data file (every backend: uring and pwrite fsync from C, buffered from
    Python), on MANIFEST, on the tmp dir, or on the parent after the rename: the save raises the
    typed error naming fsync and that path, and nothing is committed; in the last case the rename
    is undone, since a save that raised must leave nothing visible."""
    _need_strace()
    root = str(tmp_path / "ckpt")
    os.mkdir(root)
    _save_prev(root)
    name = errno.errorcode[code]
    cases = _fsync_cases(code)
    results = _strace_python(_child_code(_FSYNC_CHILD, root=root, cases=cases, step=_FSYNC_STEP),
                             [f"inject=fsync:error={name}:when={_FSYNC_STEP}+{_FSYNC_STEP}"])
    assert len(results) == len(cases)
    for i, out in enumerate(results):
        backend, k = out["case"]
        _child_checks(out, root)
        err = out.get("error")
        _assert_typed_dict(err, cls, code, operation="fsync")
        assert "fsync failed" in err["message"], err["message"]
        rel = os.path.relpath(err["path"], root)
        expect = {1: ".step_*.tmp-*/rank00000.bin", 2: ".step_*.tmp-*/MANIFEST", 3: ".step_*.tmp-*", 4: "."}[k]
        assert fnmatch.fnmatch(rel, expect), (out["case"], rel)
        if code == errno.EIO:
            assert "not retried" in err["remedy"]
        assert f"step_{i + 2}" not in out["listing"], out
    _assert_nothing_committed(root, failed="step_2")
    _assert_prev_intact(root)


# ------------------------------------------------------------------------------------------------
# EFBIG (RLIMIT_FSIZE): typed, and SIGXFSZ never kills the process

_EFBIG_CHILD = """
# An embedding application reset SIGXFSZ to its default action (kill): distckpt must cope.
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
results = []
for i, backend in enumerate(backends):
    fresh(DISTCKPT_IO_BACKEND=backend)
    out = attempt(os.path.join(root, f"step_{i + 2}"), big_state(12 << 20))
    out["backend"] = backend
    results.append(out)
emit(results)
"""


def test_efbig_rlimit_fsize(tmp_path):
    root = str(tmp_path / "ckpt")
    os.mkdir(root)
    _save_prev(root)
    res = run_python(_child_code(_EFBIG_CHILD, root=root, backends=list(BACKENDS)),
                     rlimits={resource.RLIMIT_FSIZE: (4 * MiB, 4 * MiB)}, timeout=90)
    res.check()  # not killed by SIGXFSZ
    for out in res.data:
        _child_checks(out, root)
        _assert_typed_dict(out.get("error"), "FileTooLargeError", errno.EFBIG, operation=_space_op(out["backend"]))
    _assert_nothing_committed(root)
    _assert_prev_intact(root)


# ------------------------------------------------------------------------------------------------
# EMFILE (RLIMIT_NOFILE): every place a save opens an fd, one after the other

_EMFILE_CHILD = """
import resource
results = []
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
for backend in backends:
    fresh(DISTCKPT_IO_BACKEND=backend)
    distckpt.save(big_state(1 << 16), os.path.join(root, f"warm_{backend}"))  # lazy imports, caches
    for reprobe, spare in [(r, s) for r in (True, False) for s in range(10)]:
        if reprobe:
            fresh()  # forget the backend choice: the probe's opens are swept too
        path = os.path.join(root, f"step_{backend}_{int(reprobe)}{spare}")
        before = open_fds()
        out = {"path": path, "backend": f"{backend}/{'probe' if reprobe else 'cached'}", "spare": spare}
        # fds are allocated lowest first: about `spare` more may open
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest_fd() + 1 + spare, hard))
        try:
            distckpt.save(big_state(1 << 20), path)
            out["ok"] = True
        except Exception as exc:
            out["error"] = error_dict(exc)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        after = open_fds()
        out["leaked_fds"] = {str(k): v for k, v in after.items() if before.get(k) != v}
        out["listing"] = sorted(os.listdir(root))
        results.append(out)
emit(results)
"""


def test_emfile_sweep(tmp_path):
    """RLIMIT_NOFILE leaves 0, 1, ... 9 spare fds (pre-flight asks for 8), with the backend probed again or cached: every
    save either succeeds or raises TooManyOpenFilesError, wherever the open failed (listing the
    parent, the probe, the data file, the ring, MANIFEST, a directory fsync), and the aborted
    save's tmp dir is removed even though the fd table is still full."""
    root = str(tmp_path / "ckpt")
    os.mkdir(root)
    _save_prev(root)
    res = run_python(_child_code(_EMFILE_CHILD, root=root, backends=["uring", "buffered"]), timeout=90).check()
    outcomes: dict[str, list[str]] = {}
    for out in res.data:
        _child_checks(out, root)
        name = os.path.basename(out["path"])
        if "error" in out:
            _assert_typed_dict(out["error"], "TooManyOpenFilesError", errno.EMFILE)
            assert name not in out["listing"], (name, out["listing"])
            outcomes.setdefault(out["backend"], []).append("E")
        else:
            assert name in out["listing"]
            outcomes.setdefault(out["backend"], []).append("ok")
    for backend, seq in outcomes.items():
        assert seq[0] == "E" and seq[-1] == "ok", (backend, seq)
    _assert_prev_intact(root)


# ------------------------------------------------------------------------------------------------
# EROFS and EACCES


@pytest.mark.root
def test_erofs_readonly_mount(tmp_path, monkeypatch):
    _reset(monkeypatch)
    with readonly_mount(tmp_path / "ro", size="8m", populate=lambda p: _save_prev(str(p))) as d:
        root = str(d)
        reset_choices()
        before = open_fds()
        with pytest.raises(E.StoragePermissionError) as ei:
            distckpt.save(_big_state(1 * MiB), os.path.join(root, "step_2"))
        assert open_fds() == before
        _assert_typed(ei.value, E.StoragePermissionError, errno.EROFS)
        assert isinstance(ei.value, PermissionError)
        assert "read-only" in ei.value.remedy
        _assert_nothing_committed(root)
        _assert_prev_intact(root)  # and the read-only checkpoint still loads
        with pytest.raises(E.StoragePermissionError) as ei:
            distckpt.CheckpointManager(root, keep_last=1).save(2, _big_state(1 * MiB))
        _assert_typed(ei.value, E.StoragePermissionError, errno.EROFS)


_EACCES_CHILD = """
results = [attempt(os.path.join(root, "step_2"), big_state(1 << 20))]
# Load side: the data file is mode 000 (owner root, but without CAP_DAC_* bits are enforced).
results.append(attempt(os.path.join(root, "step_1"), None, fn=lambda _s, p: distckpt.read(p)))
emit(results)
"""


@pytest.mark.root
def test_eacces_without_dac_override(tmp_path):
    require_root("dropping CAP_DAC_OVERRIDE and chown")
    root = str(tmp_path / "ckpt")
    os.mkdir(root)
    _save_prev(root)
    data = os.path.join(root, "step_1", "rank00000.bin")
    os.chmod(data, 0)
    os.chown(root, 65534, 65534)  # not ours any more: creating the tmp dir needs DAC override
    try:
        res = run_python(_child_code(_EACCES_CHILD, root=root), drop_caps=("cap_dac_override", "cap_dac_read_search"),
                         timeout=90).check()
    finally:
        os.chown(root, 0, 0)
        os.chmod(data, 0o644)
    save_out, load_out = res.data
    for out in (save_out, load_out):
        _child_checks(out, root)
        _assert_typed_dict(out.get("error"), "StoragePermissionError", errno.EACCES)
        assert "PermissionError" in out["error"]["mro"]
    assert load_out["error"]["path"] == data
    _assert_nothing_committed(root)
    _assert_prev_intact(root)


# ------------------------------------------------------------------------------------------------
# io_uring refused by a seccomp filter

_SECCOMP_CHILD = """
from tests.helpers import seccomp as _seccomp
_seccomp.deny_io_uring_setup()
results = []
fresh(DISTCKPT_IO_BACKEND="auto")
results.append(attempt(os.path.join(root, "step_2"), big_state(1 << 20)))
fresh(DISTCKPT_IO_BACKEND="uring")
results.append(attempt(os.path.join(root, "step_3"), big_state(1 << 20)))
fresh(DISTCKPT_IO_BACKEND="auto")
got = distckpt.read(os.path.join(root, "step_2"))
results.append({"read_ok": bool(torch.equal(got["model"]["w"], big_state(1 << 20)["model"]["w"]))})
emit(results)
"""


@pytest.mark.skipif(not _seccomp.supported(), reason="the seccomp filter is written for x86_64 syscall numbers")
def test_io_uring_denied_by_seccomp(tmp_path):
    root = str(tmp_path / "ckpt")
    os.mkdir(root)
    _save_prev(root)
    res = run_python(_child_code(_SECCOMP_CHILD, root=root), timeout=90).check()
    auto, forced, read = res.data
    _child_checks(auto, root)
    assert "error" not in auto, auto
    assert auto["ok"]["backend"] == "pwrite", auto
    assert "io_uring" in auto["ok"]["reason"] and "EPERM" in auto["ok"]["reason"], auto["ok"]["reason"]
    _child_checks(forced, root)
    err = forced.get("error")
    _assert_typed_dict(err, "IOBackendUnavailableError", errno.EPERM)
    assert "step_3" not in forced["listing"]
    assert read["read_ok"]
    _assert_prev_intact(root)


# ------------------------------------------------------------------------------------------------
# Two ranks, one of them hits ENOSPC


def _two_rank_enospc_body(rank, world, root):
    import distckpt as dc
    from distckpt import errors as errs
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import ShardMetadata, init_from_local_shards

    from ..conftest import open_fds as fds
    # A row-sharded tensor: rank 0 holds 16 rows (1 MiB), rank 1 the other 400 (25 MiB), so rank 1's
    # data file cannot fit the 16 MiB tmpfs both share, while rank 0's does.
    cols = 16384
    bounds = [0, 16, 416]
    lo, hi = bounds[rank], bounds[rank + 1]
    local = torch.full((hi - lo, cols), float(rank + 1))
    md = ShardMetadata(shard_offsets=[lo, 0], shard_sizes=[hi - lo, cols], placement=f"rank:{rank}/cpu")
    st = init_from_local_shards([STShard(tensor=local, metadata=md)], bounds[-1], cols)
    from distckpt._dist import control_group
    control_group()  # the gloo side group (sockets, pipes) lives for the process: not a leak
    before = fds()
    t0 = time.monotonic()
    try:
        dc.save({"emb": st, "step": 2}, os.path.join(root, "step_2"))
    except errs.DiskFullError as exc:  # rank 1's class, raised on every rank (errors.collective_error)
        elapsed = time.monotonic() - t0
        leaked = {k: v for k, v in fds().items() if before.get(k) != v}
        return {"type": type(exc).__name__, "failures": exc.failures, "rank": exc.rank,
                "remedy": exc.remedy, "elapsed": elapsed, "leaked": leaked, "message": str(exc)}
    raise AssertionError("the save must fail on every rank")


@pytest.mark.root
def test_two_ranks_one_hits_enospc(tmp_path, monkeypatch):
    _reset(monkeypatch)
    with tmpfs_mount(tmp_path / "m", "16m") as d:
        root = str(d)
        _save_prev(root)
        outs = run_ranks(_two_rank_enospc_body, 2, root, timeout=120,
                         env={"DISTCKPT_PREFLIGHT": "0", "DISTCKPT_TIMEOUT_S": "60"})
        for r, out in enumerate(outs):
            assert out["type"] == "DiskFullError" and out["rank"] == 1 and out["remedy"]
            assert out["elapsed"] < 30, f"rank {r} took {out['elapsed']:.1f} s to learn of the failure"
            assert not out["leaked"], out["leaked"]
            assert set(out["failures"]) == {1}, out["message"]
            f = out["failures"][1]
            _assert_typed(f, E.DiskFullError, errno.ENOSPC, operation=_space_op("auto"))
            assert f.rank == 1 and os.path.basename(f.path) == "rank00001.bin"
        _assert_nothing_committed(root)
        _assert_prev_intact(root)


# ------------------------------------------------------------------------------------------------
# Load side: read errors and files that are not what the manifest says

_READ_EIO_CHILD = """
results = []
for backend in backends:
    fresh(DISTCKPT_IO_BACKEND=backend)
    out = attempt(os.path.join(root, "step_1"), None, fn=lambda _s, p: distckpt.read(p))
    out["backend"] = backend
    results.append(out)
emit(results)
"""


def test_eio_on_read(tmp_path):
    """EIO from the data reads (pread64 of the C pwrite reader, preadv2 of the buffered one):
    read() raises StorageIOError with the data file's path and closes its fds. Only syscalls on
    the data file fail (-P): the dynamic loader reads libraries with pread64 too."""
    _need_strace()
    root = str(tmp_path / "ckpt")
    os.mkdir(root)
    _save_prev(root)
    results = _strace_python(_child_code(_READ_EIO_CHILD, root=root, backends=["pwrite", "buffered"]),
                             ["inject=pread64,preadv,preadv2:error=EIO"],
                             only_paths=[os.path.join(root, "step_1", "rank00000.bin")])
    for out in results:
        _child_checks(out, root)
        _assert_typed_dict(out.get("error"), "StorageIOError", errno.EIO, operation="read")
        assert os.path.basename(out["error"]["path"]) == "rank00000.bin", out
    _assert_prev_intact(root)  # nothing was damaged by the failed reads


@pytest.mark.parametrize("replacement", ["directory", "symlink_outside", "symlink_inside"])
def test_data_file_replaced_does_not_escape(tmp_path, monkeypatch, replacement):
    """I7: a data file that is a directory or a symlink is refused, typed, before any read; in
    particular a symlink to an identical copy outside the checkpoint is not followed."""
    _reset(monkeypatch)
    root = str(tmp_path / "ckpt")
    os.mkdir(root)
    _save_prev(root)
    ckpt = os.path.join(root, "step_1")
    data = os.path.join(ckpt, "rank00000.bin")
    outside = str(tmp_path / "outside.bin")
    shutil.copyfile(data, outside)  # same bytes, same size, valid checksums
    os.unlink(data)
    if replacement == "directory":
        os.mkdir(data)
    elif replacement == "symlink_outside":
        os.symlink(outside, data)
    else:
        shutil.copyfile(outside, os.path.join(ckpt, "copy.bin"))
        os.symlink("copy.bin", data)
    before = open_fds()
    with pytest.raises(E.CheckpointCorruptError) as ei:
        distckpt.read(ckpt)
    assert open_fds() == before
    assert ei.value.path == data and ei.value.remedy and ei.value.rank is not None
    assert "regular file" in ei.value.message, ei.value.message
    into = {"model": {"w": torch.zeros(256, 64), "b": torch.zeros(77, dtype=torch.bfloat16)},
            "step": 0, "note": ""}
    with pytest.raises(E.CheckpointCorruptError):
        distckpt.load(into, ckpt)
    assert not torch.any(into["model"]["w"]), "bytes from outside the checkpoint reached the tensor"
