"""The checks a save runs on this host before it writes (when ``DISTCKPT_PREFLIGHT`` is on).

* :func:`refuse_pseudo_fs`: a local target is not on a kernel pseudo file system (/proc, /sys,
  ...); checked for a root before its first save, and in PREPARE on the checkpoint's parent.
* :func:`check_save_space` (PREPARE, rank 0, local paths): the file system has the bytes of every
  rank, and the :data:`SAVE_INODES` inodes of a one-rank save.
* :func:`check_fd_limit` (the save plan, every rank, whatever the store): RLIMIT_NOFILE leaves room
  for the fds a save opens (its writer and ring, reader probes, directory fsyncs).

Each is cheap (a statvfs, one read of the mount table, a listing of /proc/self/fd) and raises the
typed error a failing write would have raised later, with the numbers and a remedy. The same
functions feed the report of ``distckpt preflight`` (:mod:`distckpt.checks.filesystem`). Nothing
here writes, and nothing keeps an fd open.
"""

from __future__ import annotations

import errno as _errno
import os
import resource

from ...errors import DiskFullError, StorageError, TooManyOpenFilesError, format_bytes
from .mounts import MountInfo, find_mount, fs_summary, nearest_existing_dir

__all__ = [
    "PSEUDO_FILE_SYSTEMS",
    "refuse_pseudo_fs",
    "pseudo_fs_error",
    "check_save_space",
    "disk_remedy",
    "check_fd_limit",
    "open_fd_count",
]

#: Kernel interfaces that look like directories but cannot hold files: their zero free bytes are
#: not a full disk, so saving there is reported as the wrong place, never as DiskFullError.
PSEUDO_FILE_SYSTEMS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "devpts",
    "pstore", "bpf", "mqueue", "fusectl", "binfmt_misc", "efivarfs", "selinuxfs", "nsfs", "autofs",
    "rpc_pipefs", "nfsd",
})


def pseudo_fs_error(path: str, mount: MountInfo, rank: int | None) -> StorageError:
    """The error for a checkpoint ``path`` on the pseudo file system ``mount`` (returned, not
    raised, so a report can carry it)."""
    return StorageError(
        f"{path} is on {mount.mount_point} ({mount.fstype}), a kernel pseudo file system that cannot "
        "hold a checkpoint", path=path, rank=rank, mount_point=mount.mount_point, fstype=mount.fstype,
        remedy="Save to a directory on a real file system (ext4, xfs, a network file system, or tmpfs "
               "for tests).")


def refuse_pseudo_fs(path: str | os.PathLike, *, rank: int | None = None) -> None:
    """Raise unless ``path`` (or its nearest existing ancestor) lies on a real file system.

    Runs before anything else touches the target directory (the save lock, the tmp dir), so saving
    under /proc or /sys is reported as the wrong place instead of as whatever the first file
    operation there fails with. Read-only.

    Raises:
        StorageError: with ``mount_point`` and ``fstype`` when the file system is one of
            :data:`PSEUDO_FILE_SYSTEMS`.
    """
    mount = find_mount(nearest_existing_dir(path))
    if mount.fstype in PSEUDO_FILE_SYSTEMS:
        raise pseudo_fs_error(os.fspath(path), mount, rank)


def disk_remedy(mount: MountInfo, short_by: int, *, inodes: bool = False) -> str:
    """The remedy sentence of a DiskFullError on ``mount``, ``short_by`` bytes missing
    (``inodes``: it is out of inodes, files rather than bytes)."""
    amount = (f"at least {format_bytes(short_by)} " if short_by > 0
              else "inodes (files) " if inodes else "space ")
    return (f"Free {amount}on {mount.mount_point}: delete old checkpoints or lower keep_last "
            "(rotation frees space only after a new checkpoint is durable), make processes close "
            "deleted files they still hold (see the deleted_open_files check), or save to a larger "
            "volume.")


def check_save_space(path: str | os.PathLike, needed_bytes: int, *, rank: int | None = None) -> None:
    """Raise unless the file system holding ``path`` has ``needed_bytes`` free (and
    :data:`SAVE_INODES` inodes).

    Cheap (one statvfs and one read of /proc/self/mountinfo): PREPARE calls it before the save
    area is created.

    Raises:
        StorageError: ``path`` is on a kernel pseudo file system (see :func:`refuse_pseudo_fs`).
        DiskFullError: errno ENOSPC, with ``needed``, ``free``, ``free_inodes`` (None where the
            file system keeps no inode count), ``needed_inodes``, ``mount_point`` and ``fstype``.
        OSError: statvfs itself failed.
    """
    path = os.fspath(path)
    mount, st, _ = fs_summary(path)
    if mount.fstype in PSEUDO_FILE_SYSTEMS:
        raise pseudo_fs_error(path, mount, rank)
    free = st.f_bavail * st.f_frsize
    # f_files 0: a file system without an inode count (btrfs, some network ones)
    no_inodes = st.f_files > 0 and st.f_favail < SAVE_INODES
    if free >= needed_bytes and not no_inodes:
        return
    short = (f"checkpoint needs {format_bytes(needed_bytes)} on {mount.mount_point} ({mount.fstype}), "
             f"{format_bytes(free)} free")
    if no_inodes:
        short += f" and {st.f_favail} of {st.f_files} inodes free (a save needs {SAVE_INODES})"
    raise DiskFullError(short, path=path, rank=rank, errno=_errno.ENOSPC, needed=needed_bytes,
                        free=free, free_inodes=st.f_favail if st.f_files > 0 else None,
                        needed_inodes=SAVE_INODES, mount_point=mount.mount_point,
                        fstype=mount.fstype, remedy=disk_remedy(mount, needed_bytes - free, inodes=no_inodes))


#: Inodes a one-rank save may create: its temporary directory, its data file, the MANIFEST, the
#: root's lock and ``latest`` files and their temporary names, with a margin. A save of N ranks
#: into one directory creates N - 1 more data files, which this check does not count (rank 0
#: checks before the plan's writers are known to the store): a file system that runs out at one
#: of them fails that rank's create with the same DiskFullError and inode remedy
#: (:func:`distckpt.errors.from_os_error`), before anything is committed.
SAVE_INODES = 8


MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


def memory_available() -> int:
    """MemAvailable + SwapFree from /proc/meminfo, in bytes (what more tmpfs pages can take
    without the OOM killer); raises OSError when it cannot be read, KeyError when it has no
    MemAvailable line (kernels before 3.14)."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024
    return fields["MemAvailable"] + fields.get("SwapFree", 0)


def check_memory_room(path: str | os.PathLike, needed_bytes: int, *, rank: int | None = None) -> bool:
    """When ``path`` is on a memory file system (tmpfs, ramfs: a tier in host memory), raise
    unless the host's available memory holds ``needed_bytes`` more. Returns whether ``path`` is
    on one. A tmpfs's own size limit is checked by :func:`check_save_space`; this is the other
    bound: a tmpfs sized beyond the RAM left (its default is half of RAM, shared by every tmpfs)
    would end in the OOM killer rather than ENOSPC.

    Raises:
        DiskFullError: errno ENOMEM, with ``needed``, ``free`` (the available memory),
            ``mount_point`` and ``fstype``.
    """
    path = os.fspath(path)
    mount, _st, _ = fs_summary(path)
    if mount.fstype not in MEMORY_FILE_SYSTEMS:
        return False
    avail = memory_available()
    if avail >= needed_bytes:
        return True
    raise DiskFullError(
        f"the memory tier on {mount.mount_point} ({mount.fstype}) needs {format_bytes(needed_bytes)} more of host "
        f"memory, {format_bytes(avail)} is available (MemAvailable + SwapFree)", path=path, rank=rank,
        errno=_errno.ENOMEM, needed=needed_bytes, free=avail, mount_point=mount.mount_point, fstype=mount.fstype,
        remedy="Lower keep_last_local (1 keeps the newest step) or replicas, give the job's hosts more memory, "
               "or put the local tier on a disk.")


# fds one rank's save may hold at once: data file + ring, MANIFEST, a directory being fsynced,
# probes, and rank 0's save lock (held for the whole save). The save checks for them before it
# writes; pre-flight adds the control group's (distckpt._dist.control_group_fds).
SAVE_FDS = 9


def open_fd_count() -> int:
    """The number of fds this process has open now (0 when /proc/self/fd cannot be listed)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the fd listdir itself used
    except OSError:
        return 0


def check_fd_limit(n_needed: int, *, rank: int | None = None, path: str | None = None) -> None:
    """Raise unless ``n_needed`` more fds fit under RLIMIT_NOFILE next to the ones open now.
    ``path`` (the checkpoint the fds are for) is carried by the error.

    Raises:
        TooManyOpenFilesError: errno EMFILE, fields ``needed``, ``open``, ``limit``, ``hard``.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    n_open = open_fd_count()
    if n_open + n_needed <= soft:
        return
    hard_txt = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    if hard == resource.RLIM_INFINITY or hard >= n_open + n_needed:
        remedy = (f"Raise the soft limit up to the hard limit ({hard_txt}): `ulimit -n {hard_txt}` "
                  "before launching, or resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)).")
    else:
        remedy = (f"The hard limit ({hard_txt}) is too low as well: raise it (limits.conf, "
                  "docker --ulimit nofile=65536:65536, systemd LimitNOFILE) or close files the job "
                  "keeps open.")
    raise TooManyOpenFilesError(
        f"the save needs {n_needed} file descriptors but only {max(soft - n_open, 0)} are left "
        f"({n_open} open, RLIMIT_NOFILE soft limit {soft}, hard limit {hard_txt})",
        rank=rank, path=path, errno=_errno.EMFILE, remedy=remedy, needed=n_needed, open=n_open,
        limit=soft, hard=hard)
