"""The local file system a checkpoint goes to: free bytes and inodes (next to the checkpoints
rotation still keeps), TMPDIR, space held by deleted-but-open files, a probe file, the fd limit and
the I/O backend. The guards a save itself runs (:mod:`distckpt.storage.posix.guards`) are reported
here with the same numbers; the checks below go further than a save does (a probe write, the
steady state of rotation, other processes' open files)."""

from __future__ import annotations

import errno as _errno
import os
import resource
import stat
import tempfile
import uuid
from typing import Any, Mapping

from ..errors import ConfigError, DiskFullError, DistCkptError, TooManyOpenFilesError, format_bytes, from_os_error
from ..manifest import MANIFEST_NAME
from ..storage.posix import choose_backend
from ..storage.posix.guards import (
    PSEUDO_FILE_SYSTEMS,
    check_fd_limit,
    disk_remedy,
    open_fd_count,
    pseudo_fs_error,
)
from ..storage.posix.mounts import find_mount, fs_summary, nearest_existing_dir
from .environment import env_of
from .report import ERROR, OK, WARNING, CheckResult, finish

__all__ = [
    "FILES_BESIDES_DATA",
    "disk_check",
    "tmpdir_check",
    "deleted_open_files_check",
    "check_writable",
    "writable_check",
    "fd_limit_check",
    "io_backend_check",
]

# Files a save creates besides one data file per rank (MANIFEST, the save area, the save lock, the
# parent's entry): each takes an inode.
FILES_BESIDES_DATA = 4


def _count_committed(path: str) -> int:
    """Committed checkpoints of a CheckpointManager root at ``path``: step_* directories holding
    their MANIFEST. 0 when ``path`` cannot be listed."""
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    return sum(1 for n in names if n.startswith("step_")
               and os.path.isfile(os.path.join(path, n, MANIFEST_NAME)))



def disk_check(path: str | os.PathLike, expected_bytes: int | None = None, *,
               keep_last: int | None = None, n_files: int | None = None,
               rank: int | None = None) -> CheckResult:
    """Check free bytes and inodes of the checkpoint file system.

    ``expected_bytes`` is what this save writes to that file system (all ranks' bytes summed when
    it is shared). Old checkpoints are deleted by rotation only after the new one is durable, so
    the new checkpoint must fit next to them: free >= expected_bytes, else DiskFullError. With
    ``keep_last=k``, the steady state holds k+1 checkpoints during a save; when fewer exist now,
    a warning says later saves will run out. ``n_files`` files need as many inodes.
    """
    path = os.fspath(path)
    mount, st, existing = fs_summary(path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    details: dict[str, Any] = {
        "mount_point": mount.mount_point, "fstype": mount.fstype, "source": mount.source,
        "checked_dir": existing, "free": free, "total": total, "free_inodes": st.f_favail,
        "total_inodes": st.f_files, "needed": expected_bytes,
    }
    # f_files == 0: the file system keeps no inode count (btrfs, tmpfs nr_inodes=0, some FUSE)
    free_inodes = st.f_favail if st.f_files > 0 else None
    details["free_inodes"] = free_inodes
    inodes_text = f"{free_inodes} inodes free" if free_inodes is not None else "no inode limit"
    where = f"{mount.mount_point} ({mount.fstype})"
    errors: list[DistCkptError] = []
    warnings: list[str] = []
    if mount.fstype in PSEUDO_FILE_SYSTEMS:
        return finish("disk", [pseudo_fs_error(path, mount, rank)], warnings, "", details)
    n_files = n_files or 1 + FILES_BESIDES_DATA
    if st.f_files > 0 and st.f_favail < n_files:  # f_files == 0: no inode limit (btrfs, some FUSE)
        errors.append(DiskFullError(
            f"checkpoint needs {n_files} inodes on {where}, {st.f_favail} of {st.f_files} free",
            path=path, rank=rank, errno=_errno.ENOSPC, needed=expected_bytes, free=free,
            needed_inodes=n_files, free_inodes=st.f_favail, mount_point=mount.mount_point,
            fstype=mount.fstype,
            remedy=f"Delete files on {mount.mount_point} (many small files use up inodes) or save to "
                   "a file system with free inodes (`df -i` shows them)."))
    if expected_bytes is None:
        return finish("disk", errors, warnings,
                       f"{format_bytes(free)} free of {format_bytes(total)} on {where}, "
                       f"{inodes_text} (expected size not given)", details)
    existing_ckpts = _count_committed(path)
    details["committed_checkpoints"] = existing_ckpts
    rotation = (f" (rotation to keep_last={keep_last} deletes old checkpoints only after the new one "
                "is durable)" if keep_last else "")
    if free < expected_bytes:
        errors.append(DiskFullError(
            f"checkpoint needs {format_bytes(expected_bytes)} on {where}, {format_bytes(free)} free; "
            f"the new checkpoint must fit while the old ones still exist{rotation}",
            path=path, rank=rank, errno=_errno.ENOSPC, needed=expected_bytes, free=free,
            free_inodes=free_inodes, mount_point=mount.mount_point, fstype=mount.fstype,
            remedy=disk_remedy(mount, expected_bytes - free)))
    elif keep_last:
        more = max(1, keep_last + 1 - existing_ckpts)
        future = expected_bytes * more
        details["steady_state_needed"] = future
        if free < future:
            warnings.append(
                f"with keep_last={keep_last}, {keep_last + 1} checkpoints exist at once during a "
                f"save and {existing_ckpts} exist now: {more} more x {format_bytes(expected_bytes)} = "
                f"{format_bytes(future)} needed on {where}, {format_bytes(free)} free; a later save "
                "will run out of space")
    ok = (f"checkpoint needs {format_bytes(expected_bytes)} on {where}, {format_bytes(free)} free, "
          f"{inodes_text}; the new checkpoint fits while the old ones still exist")
    return finish("disk", errors, warnings, ok, details)


def tmpdir_check(path: str | os.PathLike, expected_bytes: int | None = None,
                 env: Mapping[str, str] | None = None, *,
                 min_bytes: int = 1 << 30) -> CheckResult:
    """Check TMPDIR's free space (warning level only).

    distckpt does not stage checkpoints in TMPDIR, but torch does put files there (compile caches,
    DataLoader's file_system sharing strategy, multiprocessing sockets), and a full TMPDIR fails a
    job in ways that look unrelated. The threshold is min(expected_bytes, ``min_bytes``).
    """
    env = env_of(env)
    tmp = env.get("TMPDIR") or tempfile.gettempdir()
    details: dict[str, Any] = {"tmpdir": tmp}
    if not os.path.isdir(tmp):
        return CheckResult("tmpdir", WARNING, f"TMPDIR={tmp!r} does not exist: Python silently falls "
                           "back to another directory and torch's temp files land there", details)
    try:
        same = os.stat(tmp).st_dev == os.stat(nearest_existing_dir(path)).st_dev
        mount, st, _ = fs_summary(tmp)
    except OSError as exc:
        return CheckResult("tmpdir", WARNING, f"cannot inspect TMPDIR {tmp}: {exc}", details)
    free = st.f_bavail * st.f_frsize
    need = min(expected_bytes, min_bytes) if expected_bytes else min_bytes
    details.update(free=free, needed=need, mount_point=mount.mount_point, fstype=mount.fstype,
                   same_fs_as_checkpoint=same)
    where = f"TMPDIR {tmp} on {mount.mount_point} ({mount.fstype})"
    warnings = []
    if free < need:
        warnings.append(f"{where} has {format_bytes(free)} free, less than {format_bytes(need)}: "
                        "torch's temporary files may fill it (set TMPDIR to a larger file system)")
    if st.f_files > 0 and st.f_favail == 0:
        warnings.append(f"{where} has no free inodes")
    if not os.access(tmp, os.W_OK):
        warnings.append(f"{where} is not writable by this user")
    same_note = " (same file system as the checkpoint)" if same else ""
    return finish("tmpdir", [], warnings, f"{where}: {format_bytes(free)} free{same_note}", details)


def _comm(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def deleted_open_files_check(path: str | os.PathLike, *, min_bytes: int = 1 << 20,
                             proc: str = "/proc", max_examples: int = 3) -> CheckResult:
    """Find space on the checkpoint's file system held by files that are deleted but still open.

    Scans /proc/self/fd and every other /proc/PID/fd this user may read. A link ending in
    " (deleted)" whose target (os.stat follows /proc/PID/fd/N to the open file) lives on the same
    device as ``path`` still occupies its blocks (st_blocks * 512): df counts them, du does not. A
    process holding at least ``min_bytes`` is a warning naming the pid, its name, the bytes and
    example paths. This is what a leaked fd to a rotated checkpoint looks like.
    """
    path = os.fspath(path)
    existing = nearest_existing_dir(path)
    dev = os.stat(existing).st_dev
    mount = find_mount(existing)
    holders: dict[str, dict[str, Any]] = {}
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        pids = []
    for pid in pids:
        fd_dir = f"{proc}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # other users' processes, or gone already
            continue
        for fd in fds:
            link = f"{fd_dir}/{fd}"
            try:
                target = os.readlink(link)
                if not target.endswith(" (deleted)"):
                    continue
                st = os.stat(link)
            except OSError:
                continue
            if st.st_dev != dev or not stat.S_ISREG(st.st_mode):
                continue
            h = holders.setdefault(pid, {"pid": int(pid), "comm": _comm(pid), "bytes": 0,
                                         "files": 0, "examples": [], "_inodes": set()})
            if st.st_ino in h["_inodes"]:  # the same file open twice holds its blocks once
                continue
            h["_inodes"].add(st.st_ino)
            h["bytes"] += st.st_blocks * 512
            h["files"] += 1
            if len(h["examples"]) < max_examples:
                h["examples"].append(target[: -len(" (deleted)")])
    for h in holders.values():
        del h["_inodes"]
    found = sorted(holders.values(), key=lambda h: -h["bytes"])
    details = {"mount_point": mount.mount_point, "fstype": mount.fstype, "holders": found,
               "total_bytes": sum(h["bytes"] for h in found)}
    where = f"{mount.mount_point} ({mount.fstype})"
    me = os.getpid()
    warnings = [
        f"df says full and du says small: process {h['pid']} ({h['comm']}"
        f"{', this process' if h['pid'] == me else ''}) holds {format_bytes(h['bytes'])} in "
        f"{h['files']} deleted file(s) on {where}, e.g. {', '.join(h['examples'])}; the space "
        "returns only when it closes them (or exits)"
        for h in found if h["bytes"] >= min_bytes]
    total = details["total_bytes"]
    ok = (f"no deleted-but-open files hold space on {where}" if not found else
          f"deleted-but-open files hold {format_bytes(total)} on {where} (below "
          f"{format_bytes(min_bytes)} per process)")
    return finish("deleted_open_files", [], warnings, ok, details)



def check_writable(directory: str | os.PathLike, *, rank: int | None = None) -> None:
    """Create, write, fsync and unlink a probe file in ``directory`` (or its nearest existing
    parent when it does not exist yet, since save() will create it there).

    Uses O_CREAT|O_EXCL with a unique name, so it never touches an existing file; the probe is
    always closed and removed, also on failure.

    Raises:
        StoragePermissionError: EACCES, EPERM or EROFS (errno kept).
        DiskFullError: ENOSPC/EDQUOT, e.g. no inode left for the probe.
        StorageError: any other OS error (via errors.from_os_error).
    """
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise from_os_error(OSError(_errno.ENOTDIR, os.strerror(_errno.ENOTDIR), directory),
                            path=directory, rank=rank, operation="use as checkpoint directory")
    target = nearest_existing_dir(directory)
    probe = os.path.join(target, f".distckpt-probe-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = -1
    created = False
    op = "create probe file"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        created = True
        op = "write probe file"
        os.write(fd, b"\0")
        op = "fsync probe file"
        os.fsync(fd)
        op = "close probe file"
        os.close(fd)
        fd = -1
        op = "unlink probe file"
        os.unlink(probe)
        created = False
    except OSError as exc:
        raise from_os_error(exc, path=target, rank=rank, operation=op) from exc
    finally:
        if fd >= 0:
            os.close(fd)
        if created:
            try:
                os.unlink(probe)
            except OSError:
                pass


def writable_check(path: str | os.PathLike, *, rank: int | None = None) -> CheckResult:
    """:func:`check_writable` as a CheckResult."""
    target = nearest_existing_dir(path)
    try:
        check_writable(path, rank=rank)
    except DistCkptError as exc:
        return CheckResult("writable", ERROR, exc.message, {"dir": target}, exc)
    note = "" if os.path.abspath(os.fspath(path)) == target else " (nearest existing parent)"
    return CheckResult("writable", OK, f"{target}{note} is writable (probe created, written, "
                       "fsynced and removed)", {"dir": target})



def fd_limit_check(n_needed: int, *, rank: int | None = None) -> CheckResult:
    """:func:`check_fd_limit` as a CheckResult."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n_open = open_fd_count()
    details = {"needed": n_needed, "open": n_open, "soft": soft, "hard": hard}
    try:
        check_fd_limit(n_needed, rank=rank)
    except TooManyOpenFilesError as exc:
        return CheckResult("fd_limit", ERROR, exc.message, details, exc)
    return CheckResult("fd_limit", OK, f"{n_needed} fds needed, {n_open} open, RLIMIT_NOFILE {soft} "
                       f"(hard {hard})", details)


def io_backend_check(path: str | os.PathLike) -> CheckResult:
    """Report which POSIX I/O backend (io_uring, O_DIRECT pwrite, buffered) a save to ``path``
    will run and why (:func:`distckpt.storage.posix.choose_backend`, which probes once per file
    system). A backend forced with DISTCKPT_IO_BACKEND that cannot run here, or a bad value of it,
    is an error carrying its typed error (IOBackendUnavailableError, ConfigError)."""
    target = nearest_existing_dir(path)
    try:
        choice = choose_backend(target)
    except DistCkptError as exc:
        variable = getattr(exc, "variable", None)
        if isinstance(exc, ConfigError) and variable != "DISTCKPT_IO_BACKEND":
            # Another variable's bad value: the distckpt_config row reports it; this one says
            # only that it could not choose.
            return CheckResult("io_backend", WARNING, f"not chosen: {variable or 'a DISTCKPT_* variable'} is invalid "
                               "(see distckpt_config)", {"dir": target})
        return CheckResult("io_backend", ERROR, exc.message, {"dir": target}, exc)
    details = {k: getattr(choice, k, None) for k in ("name", "reason", "mem_align", "offset_align",
                                                     "directory")}
    return CheckResult("io_backend", OK, f"{details['name']}: {details['reason']} (memory alignment "
                       f"{details['mem_align']}, offset alignment {details['offset_align']})", details)
