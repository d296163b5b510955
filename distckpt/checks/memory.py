"""Memory the job needs from this node: /dev/shm (NCCL's shared-memory transport between local
ranks, DataLoader workers), RLIMIT_MEMLOCK (pinned staging buffers, io_uring registered buffers,
InfiniBand registration), and whether host memory can sit on transparent huge pages (the speed of
O_DIRECT requests from it)."""

from __future__ import annotations

import errno as _errno
import os
import resource
from typing import Any, Mapping

from ..errors import SharedMemoryError, format_bytes
from .environment import env_of, int_or_none, rank_of
from .nccl import backend_parts
from .report import OK, WARNING, CheckResult, finish

__all__ = ["nccl_shm_bytes_per_rank", "shm_check", "memlock_check", "huge_pages_check"]

# NCCL's shared-memory transport (used between local ranks when CUDA P2P is unavailable, as is
# common in containers) maps one /dev/shm segment per connection and channel, holding one buffer
# per protocol: SIMPLE = NCCL_BUFFSIZE (default 4 MiB), LL = 8 lines * 512 threads * 8 steps *
# 16 B = 512 KiB, LL128 = 120 elems * 640 threads * 8 steps * 8 B = 4800 KiB, plus a 4 KiB header.
# That is 9,637,888 bytes, the exact size NCCL names in its "Error while creating shared memory
# segment /dev/shm/nccl-XXXXXX (size 9637888)" warning. We assume 2 channels (NCCL's minimum for
# PCIe-only topologies, or NCCL_MIN_NCHANNELS) and 2 connections per rank and channel (the ring
# neighbour and the tree parent/child): ~36.8 MiB per local rank, ~294 MiB for 8 GPUs, which is
# why Docker's default 64 MiB /dev/shm fails there. This is an estimate, not NCCL's exact
# allocation; it errs toward too much, and NCCL_SHM_DISABLE=1 removes it.
_NCCL_LL_BYTES = 8 * 512 * 8 * 16
_NCCL_LL128_BYTES = 120 * 640 * 8 * 8
_NCCL_SEGMENT_HEADER = 4096
_NCCL_DEFAULT_BUFFSIZE = 4 << 20
_NCCL_CONNECTIONS_PER_CHANNEL = 2
_NCCL_DEFAULT_CHANNELS = 2


def nccl_shm_bytes_per_rank(env: Mapping[str, str] | None = None) -> int:
    """Estimated /dev/shm bytes NCCL's shared-memory transport maps per local rank (0 when
    NCCL_SHM_DISABLE=1). See the comment above this function for the derivation."""
    env = env_of(env)
    if env.get("NCCL_SHM_DISABLE", "").strip() == "1":
        return 0
    buffsize = int_or_none(env.get("NCCL_BUFFSIZE")) or _NCCL_DEFAULT_BUFFSIZE
    channels = int_or_none(env.get("NCCL_MIN_NCHANNELS")) or _NCCL_DEFAULT_CHANNELS
    max_ch = int_or_none(env.get("NCCL_MAX_NCHANNELS"))
    if max_ch:
        channels = min(channels, max_ch)
    segment = buffsize + _NCCL_LL_BYTES + _NCCL_LL128_BYTES + _NCCL_SEGMENT_HEADER
    return segment * max(channels, 1) * _NCCL_CONNECTIONS_PER_CHANNEL


def shm_check(*, backend: str | None = None, local_world_size: int | None = None,
              shm_bytes_needed: int | None = None, env: Mapping[str, str] | None = None,
              shm_path: str = "/dev/shm") -> CheckResult:
    """Check /dev/shm's size and free space against what the job on this node needs.

    Needed = :func:`nccl_shm_bytes_per_rank` * local_world_size when the backend uses NCCL and more
    than one rank shares the node (all local ranks share one /dev/shm), plus ``shm_bytes_needed``
    (e.g. DataLoader workers' shared tensors). Too little -> :class:`SharedMemoryError` with the
    numbers; using it anyway would end in SIGBUS or an NCCL "unhandled system error".
    """
    env = env_of(env)
    rank = rank_of(env)
    lws = local_world_size or int_or_none(env.get("LOCAL_WORLD_SIZE")) or 1
    uses_nccl = bool(backend) and "nccl" in backend_parts(backend)
    nccl_bytes = nccl_shm_bytes_per_rank(env) * lws if uses_nccl and lws > 1 else 0
    extra = int(shm_bytes_needed or 0)
    needed = nccl_bytes + extra
    details: dict[str, Any] = {"path": shm_path, "needed": needed, "nccl_bytes": nccl_bytes,
                               "extra_bytes": extra, "local_world_size": lws}
    try:
        st = os.statvfs(shm_path)
    except OSError as exc:
        if needed:
            err = SharedMemoryError(
                f"{shm_path} is unusable ({exc.strerror}) but the job needs {format_bytes(needed)} "
                "of shared memory", path=shm_path, rank=rank, errno=exc.errno, needed=needed, free=0)
            return finish("shm", [err], [], "", details)
        return CheckResult("shm", WARNING, f"{shm_path} is unusable ({exc.strerror}); not needed by "
                           "this job's settings, but DataLoader workers and NCCL use it", details)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    details.update(size=size, free=free)
    where = f"{shm_path} is {format_bytes(size)} with {format_bytes(free)} free"
    if st.f_flag & os.ST_RDONLY:
        # Its size says nothing then: no segment can be created in it (NCCL's "unhandled system
        # error", a DataLoader worker's shared tensors failing).
        details["read_only"] = True
        if needed:
            err = SharedMemoryError(
                f"{shm_path} is mounted read-only but the job needs {format_bytes(needed)} of shared memory",
                path=shm_path, rank=rank, errno=_errno.EROFS, needed=needed, free=0,
                remedy=f"Mount {shm_path} read-write (a writable memory-backed volume in the container), or set "
                       "NCCL_SHM_DISABLE=1.")
            return finish("shm", [err], [], "", details)
        return CheckResult("shm", WARNING, f"{where} but mounted read-only; not needed by this job's settings, "
                           "but DataLoader workers and NCCL use it", details)
    if not needed:
        why = ("NCCL_SHM_DISABLE=1" if uses_nccl and env.get("NCCL_SHM_DISABLE", "").strip() == "1"
               else f"backend {backend or 'none'}, {lws} local rank(s)")
        return CheckResult("shm", OK, f"{where}; no shared-memory need estimated ({why})", details)
    parts = []
    if nccl_bytes:
        parts.append(f"NCCL shared-memory transport ~{format_bytes(nccl_bytes)} for {lws} local ranks "
                     f"({format_bytes(nccl_bytes // lws)} each)")
    if extra:
        parts.append(f"{format_bytes(extra)} requested (shm_bytes_needed)")
    if free >= needed:
        return CheckResult("shm", OK, f"{where}; job needs ~{format_bytes(needed)} "
                           f"({'; '.join(parts)})", details)
    suggest_mib = -(-int(needed * 1.25) // (1 << 20))  # 25% headroom, rounded up to MiB
    remedy = (f"Give the container at least {suggest_mib} MiB of shared memory (docker run "
              f"--shm-size={suggest_mib}m, or a larger memory-backed /dev/shm volume in Kubernetes)")
    remedy += ", or set NCCL_SHM_DISABLE=1 (NCCL then uses P2P or sockets between local ranks)." \
        if nccl_bytes else ", or use fewer DataLoader workers."
    err = SharedMemoryError(
        f"{shm_path} too small: the job needs ~{format_bytes(needed)} ({'; '.join(parts)}), "
        f"{shm_path} is {format_bytes(size)} with {format_bytes(free)} free",
        path=shm_path, rank=rank, remedy=remedy, errno=_errno.ENOSPC, needed=needed, free=free,
        size=size)
    return finish("shm", [err], [], "", details)



def memlock_check(*, pinned: bool | None = None, min_bytes: int = 64 << 20) -> CheckResult:
    """Check RLIMIT_MEMLOCK when pinned host memory will be used (warning only).

    Pinned memory is used when CUDA is available (``pinned=None`` asks torch). Locked pages count
    against RLIMIT_MEMLOCK for io_uring registered buffers and InfiniBand memory registration
    (NCCL's "ibv_reg_mr failed" in containers with the default 64 KiB-8 MiB limit), so a low limit
    makes those fail or fall back to slower pageable copies.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    details = {"soft": soft, "hard": hard, "min_bytes": min_bytes}
    if pinned is None:
        try:
            import torch
            pinned = bool(torch.cuda.is_available())
        except Exception:
            pinned = False
    details["pinned"] = pinned
    fmt = lambda v: "unlimited" if v == resource.RLIM_INFINITY else format_bytes(v)  # noqa: E731
    if not pinned:
        return CheckResult("memlock", OK, f"not relevant: no pinned memory without CUDA "
                           f"(RLIMIT_MEMLOCK {fmt(soft)})", details)
    if soft != resource.RLIM_INFINITY and soft < min_bytes:
        return CheckResult("memlock", WARNING, f"RLIMIT_MEMLOCK is {fmt(soft)} (hard {fmt(hard)}), "
                           f"below {format_bytes(min_bytes)}: pinned staging buffers and InfiniBand "
                           "registration may fail or fall back to pageable copies; raise it with "
                           "`ulimit -l unlimited` (docker --ulimit memlock=-1)", details)
    return CheckResult("memlock", OK, f"RLIMIT_MEMLOCK {fmt(soft)} (hard {fmt(hard)})", details)


_THP = "/sys/kernel/mm/transparent_hugepage"


def _bracketed(path: str) -> str | None:
    """The selected value of a sysfs choice file (``always [madvise] never`` -> ``madvise``)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text and "]" in text else None


def huge_pages_check(env: Mapping[str, str] | None = None, *, sysfs: str = _THP) -> CheckResult:
    """Report whether host memory can sit on 2 MiB transparent huge pages (never fails: a speed
    note, status ok).

    An O_DIRECT request pins its buffer's pages one by one; from 4 KiB pages that costs far more
    than from 2 MiB ones. distckpt's async staging memory asks for huge pages
    (distckpt/staging/pool.py); a sync save writes a CPU state's large tensors from their own
    memory, which is torch's: on huge pages only with ``THP_MEM_ALLOC_ENABLE=1`` (read by torch
    at its first allocation) when the kernel is in ``madvise`` mode. ``details``: ``mode``
    (always / madvise / never / None: no THP in this kernel) and ``torch_thp`` (the variable set).
    """
    env = env_of(env)
    mode = _bracketed(os.path.join(sysfs, "enabled"))
    per_size = _bracketed(os.path.join(sysfs, "hugepages-2048kB", "enabled"))
    if mode is not None and per_size not in (None, "inherit"):
        mode = per_size  # the 2 MiB size's own setting (kernels with per-size THP) overrides
    torch_thp = env.get("THP_MEM_ALLOC_ENABLE", "").strip() == "1"
    details = {"mode": mode, "torch_thp": torch_thp}
    if mode in (None, "never"):
        msg = (f"transparent huge pages {'not in this kernel' if mode is None else 'off (never)'}: "
               "a CPU state's tensors and async staging memory use 4 KiB pages, and O_DIRECT requests "
               "pin each one (saves of a CPU state ran faster from huge pages, docs/BENCHMARKS.md "
               "\"Huge pages\"); madvise mode (echo madvise > " + sysfs + "/enabled) enables them")
    elif mode == "always" or torch_thp:
        msg = f"transparent huge pages ({mode}): large CPU tensors and async staging memory use 2 MiB pages"
    else:
        msg = ("transparent huge pages (madvise): async staging memory uses 2 MiB pages; a CPU state's "
               "tensors use 4 KiB pages unless THP_MEM_ALLOC_ENABLE=1 is set before the job starts "
               "(sync saves of a CPU state ran faster with it, docs/BENCHMARKS.md \"Huge pages\")")
    return CheckResult("huge_pages", OK, msg, details)
