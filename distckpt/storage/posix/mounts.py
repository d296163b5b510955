"""Which file system holds a local path: the mount table (/proc/self/mountinfo) and statvfs.

A checkpoint directory usually does not exist before its first save, but its file system does, so
every function here answers for the path's nearest existing ancestor directory. Read-only: nothing
here creates, writes or keeps open anything.
"""

from __future__ import annotations

import dataclasses
import os
import re

__all__ = ["MountInfo", "find_mount", "nearest_existing_dir", "fs_summary"]


@dataclasses.dataclass(frozen=True)
class MountInfo:
    """One line of /proc/self/mountinfo: where a file system is mounted and what it is."""

    mount_point: str
    fstype: str
    source: str
    options: str
    device: str  # "major:minor"


def nearest_existing_dir(path: str | os.PathLike) -> str:
    """The absolute path itself if it is a directory, else its nearest existing ancestor directory
    ("/" at worst). Never raises."""
    probe = os.path.abspath(os.fspath(path))
    while not os.path.isdir(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


def _unescape_mount(raw: bytes) -> str:
    # The kernel escapes space, tab, newline and backslash in mountinfo paths as \ooo octal.
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), raw))


def find_mount(path: str | os.PathLike, *, mountinfo: str = "/proc/self/mountinfo") -> MountInfo:
    """The mount that holds ``path`` (or its nearest existing ancestor): the longest mount-point
    prefix in ``mountinfo``, the last one listed when several are stacked on one point.

    Never raises: an unreadable mount table gives ``MountInfo("/", "unknown", "unknown", "", "")``.
    """
    target = os.path.realpath(nearest_existing_dir(path) if not os.path.exists(path) else path)
    best: MountInfo | None = None
    try:
        with open(mountinfo, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        left, sep, right = line.partition(b" - ")
        fields = left.split()
        tail = right.split()
        if not sep or len(fields) < 6 or len(tail) < 2:
            continue
        mp = _unescape_mount(fields[4])
        if not (target == mp or mp == "/" or target.startswith(mp.rstrip("/") + "/")):
            continue
        if best is None or len(mp) >= len(best.mount_point):
            best = MountInfo(mp, os.fsdecode(tail[0]), _unescape_mount(tail[1]),
                             os.fsdecode(fields[5]), os.fsdecode(fields[2]))
    return best or MountInfo("/", "unknown", "unknown", "", "")


def fs_summary(path: str | os.PathLike) -> tuple[MountInfo, os.statvfs_result, str]:
    """(mount, statvfs, directory) of the file system that holds ``path``, where directory is the
    nearest existing one that was looked at.

    Raises:
        OSError: statvfs failed (the directory vanished, or EACCES on a component).
    """
    existing = nearest_existing_dir(path)
    return find_mount(existing), os.statvfs(existing), existing
