"""Which pages of host memory were written since a point in time: the kernel's write protection
(userfaultfd in asynchronous write-protect mode, Linux >= 6.7, read with the PAGEMAP_SCAN ioctl).

An incremental save (distckpt/incremental.py, ``IncrementalPolicy(watch_writes=True)``) re-hashes
only the rows that lie on pages written since its previous link instead of every tracked row.
Why the page tables and not a cheaper signal: fbgemm's fused TBE optimizers (TorchRec's
EXACT_ROWWISE_ADAGRAD, EXACT_SGD, EXACT_ADAGRAD on CPU) update the weights and the optimizer state
inside C++ without bumping the tensors' version counter (``t._version``; measured with torchrec
1.8.0 / fbgemm-gpu-cpu 1.8.0), and neither does a write through ``.data``, numpy or a C extension.
A write-protected page faults on the first write from any code path of this process, any thread,
or the kernel writing on the process's behalf (``read()`` into the memory); in the
asynchronous mode the kernel resolves that fault itself (no handler thread) and the page is
reported *written* until it is protected again.

Exact for host memory that is private and anonymous (what torch's CPU allocator returns) and that
only this process's CPUs write. Not seen, and therefore refused or not supported:
  * shared or file mappings (another process writes through its own page tables): refused, the
    range is not watched (:meth:`WriteWatch.watch` returns the reason);
  * pinned memory (``tensor.is_pinned()``, a device writes it by DMA): refused;
  * memory a device writes by DMA after pinning it outside torch (RDMA-registered buffers) and
    memory discarded with ``madvise`` while live (it reads as zeros without a write): not
    detectable from user space, so watching is opt-in (docs/INCREMENTAL.md, "Skipping unchanged
    rows").

One watcher per process (:func:`get`): a page is protected for every consumer at once, so the
watcher keeps, per page, the *epoch* of the last scan that found it written, and each consumer
compares with the epoch of its own previous scan (several savers may watch the same tensors).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import os
import struct
import threading

import torch

PAGE = os.sysconf("SC_PAGESIZE")

# <linux/userfaultfd.h> and <linux/fs.h> (the build machine's headers may predate them).
_UFFD_API = 0xAA
_UFFD_USER_MODE_ONLY = 1
_FEATURE_WP_UNPOPULATED = 1 << 13   # unpopulated pages are protected too (their first write is seen)
_FEATURE_WP_ASYNC = 1 << 15         # the kernel resolves write faults itself and marks the page written
_MODE_WP = 1 << 1                    # UFFDIO_REGISTER_MODE_WP
_WP = 1                              # UFFDIO_WRITEPROTECT_MODE_WP
_PAGE_IS_WRITTEN = 1 << 1
_PM_SCAN_WP_MATCHING = 1 << 0        # protect again the pages reported, atomically with the report
_PM_SCAN_CHECK_WPASYNC = 1 << 1      # EPERM unless the whole range is registered in async WP mode
_VEC = 4096                          # regions per PAGEMAP_SCAN call


def _ioc(direction: int, kind: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | nr


_UFFDIO_API = _ioc(3, _UFFD_API, 0x3F, 24)
_UFFDIO_REGISTER = _ioc(3, _UFFD_API, 0x00, 32)
_UFFDIO_WRITEPROTECT = _ioc(3, _UFFD_API, 0x06, 24)
_PAGEMAP_SCAN = _ioc(3, ord("f"), 16, 96)


class _Range:
    """A watched interval of whole pages and the epoch at which each page was last seen written."""

    def __init__(self, start: int, end: int, epoch: int) -> None:
        self.start, self.end = start, end
        self.epochs = torch.full(((end - start) // PAGE,), epoch, dtype=torch.int64)


class WriteWatch:
    """The process's write watcher. ``available`` is False (``reason`` says why) where the kernel
    or the process's permissions do not offer asynchronous write protection; consumers then hash
    everything, as without a watcher."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: list[_Range] = []   # disjoint, sorted by start
        self._epoch = 0
        self._uffd = -1
        self._pagemap = -1
        self.pid = os.getpid()   # its descriptors describe this process's memory only (see get())
        self.available, self.reason = False, ""
        try:
            self._open()
        except OSError as exc:
            self.reason = f"userfaultfd write protection unavailable: {exc.strerror or exc}"
            self._close()

    def _open(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        nr = {"x86_64": 323, "aarch64": 282}.get(os.uname().machine)
        if nr is None:
            raise OSError(errno.ENOSYS, f"no userfaultfd syscall number for {os.uname().machine}")
        fd = libc.syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"userfaultfd(): {os.strerror(e)}")
        self._uffd = fd
        api = bytearray(struct.pack("QQQ", _UFFD_API, _FEATURE_WP_ASYNC | _FEATURE_WP_UNPOPULATED, 0))
        fcntl.ioctl(fd, _UFFDIO_API, api, True)   # EINVAL: a kernel without these features (< 6.7)
        self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        self._vec = (ctypes.c_uint64 * (3 * _VEC))()
        self.available = True

    def _close(self) -> None:
        for fd in (self._uffd, self._pagemap):
            if fd >= 0:
                os.close(fd)
        self._uffd = self._pagemap = -1

    # -- registering -------------------------------------------------------------------------------

    def watch(self, t: torch.Tensor) -> str | None:
        """Start watching the pages under ``t``'s bytes (a no-op for pages already watched). Returns
        None when they are watched, else why not (the caller then has no write information for
        ``t`` and must treat every row as possibly changed). Never raises for an unsuitable tensor."""
        if not self.available:
            return self.reason
        span = _extent(t)
        if span is None:
            return "not a host tensor with non-negative strides"
        try:
            if t.is_pinned():
                return "pinned memory (a device may write it by DMA)"
        except RuntimeError as exc:
            return f"cannot tell whether the memory is pinned: {exc}"
        lo, hi = span[0] // PAGE * PAGE, -(-span[1] // PAGE) * PAGE
        with self._lock:
            if self._covered(lo, hi):
                return None
            why = _private_anonymous(lo, hi)
            if why is not None:
                return why
            try:
                reg = bytearray(struct.pack("QQQQ", lo, hi - lo, _MODE_WP, 0))
                fcntl.ioctl(self._uffd, _UFFDIO_REGISTER, reg, True)
                fcntl.ioctl(self._uffd, _UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", lo, hi - lo, _WP)), True)
            except OSError as exc:
                return f"cannot write-protect [{lo:#x}, {hi:#x}): {exc.strerror or exc}"
            # Pages new to the watcher count as written now: nobody has a reference for them.
            self._epoch += 1
            self._insert(lo, hi)
            return None

    def _covered(self, lo: int, hi: int) -> bool:
        i = bisect.bisect_right([r.start for r in self._ranges], lo) - 1
        return i >= 0 and self._ranges[i].start <= lo and hi <= self._ranges[i].end

    def _insert(self, lo: int, hi: int) -> None:
        """Add [lo, hi) at the current epoch, merging the ranges it overlaps or touches."""
        keep, merged = [], []
        for r in self._ranges:
            (merged if r.start <= hi and lo <= r.end else keep).append(r)
        start, end = min([lo] + [r.start for r in merged]), max([hi] + [r.end for r in merged])
        new = _Range(start, end, self._epoch)
        for r in merged:   # keep what is known of the pages already watched... then [lo, hi) is new
            new.epochs[(r.start - start) // PAGE:(r.end - start) // PAGE] = r.epochs
        new.epochs[(lo - start) // PAGE:(hi - start) // PAGE] = self._epoch
        keep.append(new)
        self._ranges = sorted(keep, key=lambda r: r.start)

    # -- scanning ----------------------------------------------------------------------------------

    def scan(self) -> int:
        """Record every watched page written since the previous scan (by anyone) at a new epoch,
        protecting it again atomically with the report, and return that epoch. A write that
        completes after a page was reported faults again and shows in a later scan; one that
        completed before this call returns is in memory before the caller reads it."""
        with self._lock:
            if not self.available:
                return self._epoch
            self._epoch += 1
            for r in list(self._ranges):
                try:
                    self._scan_range(r)
                except OSError as exc:
                    # EPERM: part of the range is no longer registered (unmapped, remapped): its
                    # pages count as written, and the range is dropped; the next watch() of a
                    # tensor there registers it again if it qualifies.
                    if exc.errno not in (errno.EPERM, errno.EINVAL, errno.ENOMEM, errno.EFAULT):
                        raise
                    r.epochs.fill_(self._epoch)
                    self._ranges.remove(r)
            return self._epoch

    def _scan_range(self, r: _Range) -> None:
        start = r.start
        vec = self._vec
        while start < r.end:
            arg = bytearray(struct.pack("12Q", 96, _PM_SCAN_WP_MATCHING | _PM_SCAN_CHECK_WPASYNC, start, r.end, 0,
                                        ctypes.addressof(vec), _VEC, 0, 0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN))
            n = fcntl.ioctl(self._pagemap, _PAGEMAP_SCAN, arg, True)
            if n:
                # Regions [a, b) of written pages -> their pages' epochs, vectorised (a Python
                # loop over thousands of scattered one-page regions cost more than the hashing
                # it saves).
                reg = torch.frombuffer(vec, dtype=torch.int64, count=3 * n).view(n, 3)
                first = (reg[:, 0] - r.start) // PAGE
                last = (reg[:, 1] - r.start) // PAGE
                mark = torch.zeros(r.epochs.numel() + 1, dtype=torch.int32)
                mark.index_add_(0, first, torch.ones_like(first, dtype=torch.int32))
                mark.index_add_(0, last, torch.full_like(last, -1, dtype=torch.int32))
                r.epochs[torch.cumsum(mark[:-1], 0) > 0] = self._epoch
            walk_end = struct.unpack_from("Q", arg, 32)[0]
            if walk_end <= start:
                raise OSError(errno.EFAULT, "PAGEMAP_SCAN made no progress")
            start = walk_end

    def written_since(self, t: torch.Tensor, epoch: int) -> torch.Tensor | None:
        """The pages under ``t`` (from the page holding its first byte) written after scan
        ``epoch``, as a bool tensor, or None when some of them are not watched (no information)."""
        span = _extent(t)
        if span is None:
            return None
        lo, hi = span[0] // PAGE * PAGE, -(-span[1] // PAGE) * PAGE
        with self._lock:
            i = bisect.bisect_right([r.start for r in self._ranges], lo) - 1
            if i < 0 or not (self._ranges[i].start <= lo and hi <= self._ranges[i].end):
                return None
            r = self._ranges[i]
            return r.epochs[(lo - r.start) // PAGE:(hi - r.start) // PAGE] > epoch


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, one past the last byte] of a host tensor's elements, or None (other devices,
    negative strides, lazy conj/neg views)."""
    if t.device.type != "cpu" or t.is_conj() or t.is_neg() or any(s < 0 for s in t.stride()):
        return None
    if t.numel() == 0:
        return None
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _private_anonymous(lo: int, hi: int) -> str | None:
    """None when [lo, hi) lies in private anonymous writable mappings only (/proc/self/maps),
    else why not: another process, or a file, could write the memory without this process's
    page tables seeing it."""
    at = lo
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            a, b = (int(x, 16) for x in parts[0].split("-"))
            if b <= at:
                continue
            if a > at:
                break
            name = parts[5].strip() if len(parts) > 5 else ""
            if parts[1][1] != "w" or parts[1][3] != "p" or parts[4] != "0" or (name and not (
                    name == "[heap]" or name.startswith("[anon"))):
                return f"memory at {at:#x} is not a private anonymous mapping ({parts[1]} {name or 'anonymous'})"
            at = b
            if at >= hi:
                return None
    return f"memory at {at:#x} is not mapped"


_WATCH: WriteWatch | None = None
_WATCH_LOCK = threading.Lock()


def get() -> WriteWatch:
    """The process's watcher (created on first use). A forked child gets a watcher of its own:
    the parent's /proc/self/pagemap descriptor still reads the parent's page tables, and the
    child's mappings lose their registration at the fork (every page then counts as unknown)."""
    global _WATCH
    with _WATCH_LOCK:
        if _WATCH is None or _WATCH.pid != os.getpid():
            _WATCH = WriteWatch()
        return _WATCH
