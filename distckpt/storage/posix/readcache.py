"""Whether a load reads a data file through the page cache or around it (O_DIRECT).

Pages that are already cached are always read from the cache (storage/posix/reader.py); this
module decides the rest. ``DISTCKPT_READ_CACHE``:

  * ``auto`` (default): through the cache when the file fits it with room to spare, i.e. it is at
    most 1/``FIT_FRACTION`` of the memory the kernel can give the cache now (MemAvailable, or the
    process's memory cgroup limit when that is smaller: a container's cache pages are charged to
    it); larger files with O_DIRECT.
  * ``cache``: every data file through the cache.
  * ``direct``: O_DIRECT whenever the backend has it (uncached pages are never cached by a load).

Why ``auto`` prefers the cache for what fits (docs/BENCHMARKS.md "Load vs DCP and fio" has the
numbers): a checkpoint that fits is read again more often than not (the next load of an evaluation
job, a restart in place, the other ranks of a node that need the same replicated bytes), and an
O_DIRECT load leaves nothing behind for it, so every load of such a checkpoint paid the device's
speed; on the virtio disks measured, a cold buffered read was also as fast as or faster than an
O_DIRECT one. A file too large to stay cached gains nothing from it and would evict the training
job's own pages, so it keeps O_DIRECT. Verification does not change: every byte a load uses is
checked against its crc32c after it lands in the bounce buffer, whichever way it came.
"""

from __future__ import annotations

import time

from ...config import READ_CACHE_MODES, get_config

__all__ = ["FIT_FRACTION", "reads_through_cache", "page_cache_room"]

# A file is read through the cache by "auto" when it is at most this fraction of MemAvailable: the
# node's other ranks load their files too, and the job needs the rest of memory for itself.
FIT_FRACTION = 8
# /proc/meminfo is read at most this often (a load opens one reader per data file and pass).
_ROOM_TTL_S = 1.0
_room: tuple[float, int] | None = None


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), or None when there is none or it cannot be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            candidate = f"/sys/fs/cgroup{path.rstrip('/')}/memory.max"
        elif "memory" in controllers.split(","):
            candidate = f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.limit_in_bytes"
        else:
            continue
        try:
            with open(candidate) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (1 << 62):  # "max" or v1's near-2^63: no limit
            return int(raw)
    return None


def page_cache_room() -> int:
    """Memory the kernel can give the page cache: MemAvailable in bytes, or the memory cgroup's
    limit when smaller; read at most once a second; 0 when /proc/meminfo cannot be read (then
    ``auto`` reads with O_DIRECT)."""
    global _room
    now = time.monotonic()
    if _room is not None and now - _room[0] < _ROOM_TTL_S:
        return _room[1]
    room = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        room = 0
    limit = _cgroup_limit()
    if limit is not None:
        room = min(room, limit)
    _room = (now, room)
    return room


def reads_through_cache(file_size: int, mode: str | None = None) -> bool:
    """True when a load should read the uncached pages of a data file of ``file_size`` bytes
    through the page cache (buffered), False for O_DIRECT. ``mode`` defaults to
    ``DISTCKPT_READ_CACHE``."""
    mode = get_config().read_cache if mode is None else mode
    if mode == "cache":
        return True
    if mode == "direct":
        return False
    if mode != "auto":
        raise ValueError(f"read cache mode {mode!r} is not one of {', '.join(READ_CACHE_MODES)}")
    return file_size * FIT_FRACTION <= page_cache_room()
