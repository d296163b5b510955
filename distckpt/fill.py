"""The read pipeline of a load: saved chunks' bytes -> verified -> the caller's tensors.

What it promises (restore.load / restore.read rely on it):
  * No unverified byte reaches the caller's memory. Bytes are read into bounce buffers owned by
    this module; every checksum block a read covers is checked there first, and only a segment
    whose blocks all match is copied into the destination tensors. A load that fails on a
    checksum therefore leaves each byte of the caller's tensors either as it was or equal to the
    checkpoint's; the error names the tensors that were filled completely and those filled in part.
  * Bounded memory: ``PIPELINE_SLOTS`` bounce slots, then ``WORKERS`` bounce buffers (never both
    at once, but for the one worker of a :func:`side_reads` fill, whose buffer of about
    ``SIDE_SEGMENT`` may sit beside the slots), of ``SEGMENT`` bytes each (more only when the checkpoint's checksum block, and a
    chunk read, are larger),
    mmapped for the call and unmapped before returning or raising (inside :func:`reading`: the
    workers' buffers when the block exits; idle ones are unmapped before the slots are mapped);
    nothing is kept after a call.
  * Bounded read amplification: a wanted byte range is widened only to whole checksum blocks
    (verification needs them) and to the file system's O_DIRECT alignment; neighbouring ranges are
    merged into one read only when the gap between them is small against the bytes the read holds
    (at most 1/16 of them, and at most ``MAX_GAP``). ``bytes_read`` counts the file bytes the read
    calls asked for, gaps included.
  * Page cache aware: each read goes through :meth:`distckpt.storage.posix.Reader.read_into` or
    ``Reader.fill_segments``, which read byte ranges whose pages are all cached with a buffered
    pread and the rest with O_DIRECT.
  * Overlap: segments whose units are all flat copies into CPU memory (the common case) go
    through the C pipeline (``_uring.Reader.fill``): one thread without the GIL keeps a read in
    flight on every free one of ``PIPELINE_SLOTS`` bounce slots, and as each lands checks its
    crc32c blocks and then memcpys its runs into the destinations (one pass over bytes still in
    cache, no Python per segment or tensor). The rest (strided boxes, device destinations, readers
    without the pipeline: object stores, the buffered backend) go to ``WORKERS`` threads (for
    local files no more than the CPUs, at least 2: :func:`_workers`) that each
    read, verify and copy one segment at a time (reads, crc32c on blocks >= 32 KiB and torch's
    copies release the GIL).
  * Every reader is closed before :func:`fill` returns or raises, and every thread is joined and
    every bounce buffer unmapped by then too, unless the call runs inside :func:`reading`: the fills
    of one ``with reading():`` block (the several passes of one load) share its worker threads and
    bounce buffers, which are joined / unmapped when the block exits (never more than ``WORKERS``
    buffers, so the memory bound is the same); ``reading(keep_open=True)`` (a conversion's many
    small fills) also keeps the pipeline's slots and readers open until the block exits.
  * Ordering: a task may name, in ``after``, the key of other tasks of the same call whose bytes it
    overwrites (a chain's delta rows over its base, distckpt.incremental). A segment holding such a
    task starts only once every unit of those tasks has been copied; until then the workers take
    other segments, so one pass reads both and overlaps their work. Ordered segments never go
    through the C pipeline; it runs first, so what they wait for may be copied by either path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import ctypes
import dataclasses
import logging
import mmap
import os
import struct
import threading
import traceback
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from .checksum import crc32c
from .dcp import resolve_chunks
from .errors import ChecksumMismatchError, DistCkptError
from .plan import Box, byte_range, expand_to_blocks, is_dense_layout, outermost_dim, plan_reads, row_major_strides
from .storage import is_url, open_store
from .tensorbytes import dtype_from_name

log = logging.getLogger("distckpt")

__all__ = ["fill", "verify_read", "reading", "side_reads", "FillStats", "SEGMENT", "WORKERS", "READ_PIECE", "Task",
           "Part",
           "fill_parts", "box_tasks", "fill_boxes_of"]

# One bounce buffer per worker; a segment is one read request of at most this many bytes. Four
# 4 MiB segments keep up to ~16 MiB in flight, which reaches this kind of disk's O_DIRECT speed
# (fio at 4 MiB x 4 and 1 MiB x 16 matched 4 MiB x 8 within noise) inside the 32 MiB load budget.
SEGMENT = 4 << 20
WORKERS = 4
# Reads are merged across a gap only when it is at most this and at most 1/16 of the bytes the
# merged read already holds: fewer round trips for packed small tensors, <= 6.25 % extra bytes.
MAX_GAP = 64 << 10
# io_uring request size inside a segment: a segment's reads are split in four and run in parallel.
READ_PIECE = 1 << 20
# Bounce slots of the C pipeline (_uring.Reader.fill): one thread keeps a read in flight on every
# free slot and checks + copies each segment as it lands. Six 4 MiB slots keep ~20-24 MiB in
# flight (fio's 4 MiB x 8 reaches the disk's rate; 4 MiB x 4 fell short) inside the 32 MiB budget.
PIPELINE_SLOTS = 6
# Pipeline readers a ``reading(keep_open=True)`` block keeps open (least recently used closed
# first): one fd, one io_uring and its staging mapping each, for conversions of checkpoints with
# many data files.
MAX_OPEN_READERS = 16
# Fills inside side_reads(): small reads that run beside a load's main pass (a chain's row ids,
# read while its base is), with bounce memory small enough that both stay in the 32 MiB budget.
SIDE_SEGMENT = 1 << 20
SIDE_SLOTS = 2

# Packed records of _uring.Reader.fill (csrc/reader.c: struct fill_seg, fill_check, fill_copy,
# fill_dest); native layout, so the sizes must match the C structs (checked in tests).
_SEG = struct.Struct("@QIIIIII")
_CHECK = struct.Struct("@III")
_COPY = struct.Struct("@QIIII")
_DEST = struct.Struct("@QQ")


@dataclasses.dataclass
class FillStats:
    """What :func:`fill` did: ``bytes_read`` (file bytes requested, gaps and widening included),
    ``bytes_needed`` (bytes of the destination boxes), ``segments`` (read requests)."""

    bytes_read: int = 0
    bytes_needed: int = 0
    segments: int = 0


@dataclasses.dataclass(slots=True)
class _Unit:
    """A part of one task whose (widened) bytes lie in one segment.

    ``lo``/``hi``: the chunk-relative bytes read and verified (whole checksum blocks when
    verifying). ``start``/``end``: the chunk-relative bytes copied. Flat units copy
    ``[start, end)`` to byte ``dest_off`` of ``flat`` (a contiguous destination tensor of the saved
    dtype, addressed as bytes); strided
    units copy ``box`` (global coordinates) with an as_strided view of the chunk's layout.
    """

    task: Any
    lo: int
    hi: int
    start: int
    end: int
    flat: torch.Tensor | None
    dest_off: int
    box: Box | None
    at: int = 0  # absolute file offset of ``lo``


@dataclasses.dataclass(slots=True)
class _Segment:
    file_index: int
    offset: int          # aligned file offset
    end: int             # aligned end (may pass EOF; the read stops there)
    units: list
    deps: frozenset = frozenset()   # keys whose units must all be copied before this segment starts


def _align_down(v: int, a: int) -> int:
    return v // a * a


def _align_up(v: int, a: int) -> int:
    return -(-v // a) * a


def _flat_dest(t) -> tuple[torch.Tensor, int] | None:
    """(the destination, byte offset of the task's box in it) when the task's box is one
    contiguous byte run of a contiguous destination of the saved dtype, from a row-major chunk;
    or (a 1-D view of the destination's memory, 0) when the destination is the whole chunk laid
    out as the chunk is (:func:`_same_layout`); else None."""
    dest = t.dest
    if dest.dtype != t.dtype:
        return None
    if t.chunk.strides is not None:
        return _same_layout(t, dest)
    if not dest.is_contiguous() or dest.is_conj() or dest.is_neg():
        return None  # a lazy conj/neg view has no plain bytes to copy into: copy_ through it
    if t.inter == t.dest_box:  # the whole destination (a load with the saved sharding)
        return dest, 0
    dbox = Box(tuple(t.dest_box.offsets), tuple(t.dest_box.sizes))
    d0, d1 = byte_range(dbox, t.inter, t.itemsize)
    if d1 - d0 != t.inter.volume * t.itemsize:
        return None
    return dest, d0


def _same_layout(t, dest: Any) -> tuple[torch.Tensor, int] | None:
    """For a task whose chunk is stored strided: (a 1-D view of ``dest``'s memory, 0) when
    ``dest`` is a tensor holding exactly that chunk, densely, with the chunk's strides (a DCP
    chunk stored channels_last or transposed, loaded into a model of that layout at the sharding
    it was saved from): its bytes are then the chunk's bytes in the same order, a flat copy.
    None otherwise (a strided copy)."""
    if not isinstance(dest, torch.Tensor) or dest.is_conj() or dest.is_neg():
        return None
    sizes = tuple(t.chunk.sizes)
    if not (t.inter == t.dest_box and t.inter.offsets == tuple(t.chunk.offsets) and t.inter.sizes == sizes
            and tuple(dest.shape) == sizes):
        return None
    got = tuple(dest.stride())
    if not is_dense_layout(sizes, got) or any(a != b for a, b, n in zip(got, t.chunk.strides, sizes) if n > 1):
        return None
    return dest.as_strided((dest.numel(),), (1,)), 0


def _split_box(chunk: Box, box: Box, itemsize: int, limit: int,
               strides: Sequence[int] | None = None) -> Iterator[Box]:
    """Sub-boxes of ``box`` (inside ``chunk``, laid out by ``strides``: None is row-major) tiling
    it, each with a byte range of at most ``limit`` bytes (a single element always fits). Cut
    along the box's outermost dimension in the layout, whose slices are disjoint byte runs."""
    lo, hi = byte_range(chunk, box, itemsize, strides)
    if hi - lo <= limit:
        yield box
        return
    d = outermost_dim(box.sizes, strides)
    one = Box(box.offsets, box.sizes[:d] + (1,) + box.sizes[d + 1:])
    r0, r1 = byte_range(chunk, one, itemsize, strides)
    stride = (row_major_strides(chunk.sizes) if strides is None else strides)[d] * itemsize
    rows = 1 if r1 - r0 > limit else max(1, (limit - (r1 - r0)) // stride + 1)
    for i in range(0, box.sizes[d], rows):
        n = min(rows, box.sizes[d] - i)
        sub = Box(box.offsets[:d] + (box.offsets[d] + i,) + box.offsets[d + 1:],
                  box.sizes[:d] + (n,) + box.sizes[d + 1:])
        if n == 1 and r1 - r0 > limit:
            yield from _split_box(chunk, sub, itemsize, limit, strides)
        else:
            yield sub


def _units(t, block: int, verify: bool, limit: int) -> Iterator[_Unit]:
    """The units of task ``t``: its bytes (widened to checksum blocks) cut into parts that each
    fit ``limit`` bytes, cut at checksum block boundaries."""
    nbytes = t.chunk.nbytes
    strides = t.chunk.strides  # None: row-major; else another dense layout (a DCP chunk's)
    flat = _flat_dest(t)
    inter = t.inter
    if flat is not None and tuple(t.chunk.offsets) == inter.offsets and tuple(t.chunk.sizes) == inter.sizes:
        chunk, start, end = None, 0, nbytes  # the whole chunk (a load with the saved sharding)
    else:
        chunk = Box(tuple(t.chunk.offsets), tuple(t.chunk.sizes))
        start, end = byte_range(chunk, inter, t.itemsize, strides)
    if flat is not None and end - start == inter.volume * t.itemsize:
        dest, d0 = flat
        lo, hi = expand_to_blocks(start, end, block, nbytes) if verify else (start, end)
        step = limit if not verify else max(block, limit // block * block)
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            s, e = max(a, start), min(b, end)
            yield _Unit(t, a, b, s, e, dest, d0 + s - start, None, t.chunk.offset + a)
        return
    # Strided: the box is cut into sub-boxes whose widened byte ranges fit ``limit``.
    if chunk is None:
        chunk = Box(tuple(t.chunk.offsets), tuple(t.chunk.sizes))
    lo, hi = expand_to_blocks(start, end, block, nbytes) if verify else (start, end)
    if hi - lo <= limit:
        # All of it fits one unit: no cutting (with a block near ``limit`` the cut below would
        # leave no room and fall back to single elements, each widened to whole blocks).
        yield _Unit(t, lo, hi, start, end, None, 0, t.inter, t.chunk.offset + lo)
        return
    inner = limit - 2 * block if verify else limit
    for sub in _split_box(chunk, t.inter, t.itemsize, max(inner, t.itemsize), strides):
        s, e = byte_range(chunk, sub, t.itemsize, strides)
        lo, hi = expand_to_blocks(s, e, block, nbytes) if verify else (s, e)
        yield _Unit(t, lo, hi, s, e, None, 0, sub, t.chunk.offset + lo)


def plan_segments(file_index: int, tasks: Sequence[Any], *, block: int, verify: bool, align: int,
                  segment: int) -> list[_Segment]:
    """The read requests for one file: units sorted by file offset, packed into segments of at
    most ``segment + 2 * align`` aligned bytes (merging across small gaps only, see MAX_GAP)."""
    limit = segment if not verify else max(segment, block)
    cap = limit + 2 * align
    units = sorted((u for t in tasks for u in _units(t, block, verify, limit)), key=lambda u: u.at)
    segments: list[_Segment] = []
    cur: _Segment | None = None
    useful = 0
    for u in units:
        a = _align_down(u.at, align)
        b = _align_up(u.at + u.hi - u.lo, align)
        if cur is not None:
            gap = a - cur.end
            if gap <= min(MAX_GAP, useful // 16) and max(cur.end, b) - cur.offset <= cap and a >= cur.offset:
                cur.units.append(u)
                cur.end = max(cur.end, b)
                useful += u.hi - u.lo
                continue
        cur = _Segment(file_index, a, b, [u])
        useful = u.hi - u.lo
        segments.append(cur)
    return segments


class _Outcome:
    """Shared by the workers: the queue of segments, the first error, and which tasks were copied
    (all under one condition variable)."""

    def __init__(self, tasks_per_fqn: dict[str, int], segments: list[_Segment]) -> None:
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.left = dict(tasks_per_fqn)        # fqn -> units not yet copied
        self.touched: set[str] = set()
        self.bytes_read = 0
        self.segments = 0
        self.queue(segments)

    def queue(self, segments: list[_Segment]) -> None:
        """The segments the workers take (:meth:`next`)."""
        with self.cond:
            self.free = [s for s in reversed(segments) if not s.deps]   # popped from the end: file order
            self.waiting = [s for s in segments if s.deps]

    def failed(self) -> bool:
        return self.error is not None

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()

    def next(self) -> _Segment | None:
        """The next segment to read: a waiting one whose dependencies are copied (first, so that
        its copies overlap the other segments' reads), else the next free one; None when there is
        none left or a worker failed. Waits while only unready segments are left: their
        dependencies are free segments other workers are reading, so this always ends."""
        with self.cond:
            while self.error is None:
                for i, seg in enumerate(self.waiting):
                    if all(self.left.get(k, 0) == 0 for k in seg.deps):
                        return self.waiting.pop(i)
                if self.free:
                    return self.free.pop()
                if not self.waiting:
                    return None
                self.cond.wait()
            return None

    def copied(self, fqns: list[str], nbytes: int) -> None:
        with self.cond:
            for f in fqns:
                self.left[f] -= 1
                self.touched.add(f)
            self.bytes_read += nbytes
            self.segments += 1
            if self.waiting:
                self.cond.notify_all()

    def touch(self, fqns: list[str]) -> None:
        """Some bytes of ``fqns`` changed, but not a whole segment's: they count as partly filled."""
        with self.cond:
            self.touched.update(fqns)

    def filled(self) -> tuple[list[str], list[str]]:
        full = sorted(f for f in self.touched if self.left[f] == 0)
        part = sorted(f for f in self.touched if self.left[f] != 0)
        return full, part


def _verify(fpath: str, seg: _Segment, view: memoryview, block: int) -> None:
    for u in seg.units:
        t = u.task
        base = u.at - seg.offset
        for b in range(u.lo // block, -(-u.hi // block)):
            a = base + b * block - u.lo
            got = crc32c(view[a:a + min(block, u.hi - b * block)])
            if got != t.chunk.crcs[b]:
                raise _Bad(fpath, t, b, block, got)


def verify_read(reader: Any, fpath: str, seg: _Segment, n: int, view: memoryview, block: int) -> None:
    """Check the ``n`` bytes of ``seg`` that ``reader`` read into ``view``. A reader whose
    answers can change in transit (``reread_on_mismatch``: an object store's ranged GETs; a
    disk's bytes cannot) reads the segment once more after a mismatch, logged; a second mismatch
    is the stored bytes. Raises _Bad."""
    try:
        _verify(fpath, seg, view, block)
    except _Bad as bad:
        if not getattr(reader, "reread_on_mismatch", False):
            raise
        log.warning("distckpt: checksum mismatch in %s at byte %d (key %r): reading the range again, the first "
                    "answer may have changed in transit", bad.fpath, bad.offset, bad.fqn)
        reader.read_into([(seg.offset, n, view[:seg.end - seg.offset])])
        _verify(fpath, seg, view, block)


class _Bad(Exception):
    """A checksum mismatch found by a worker; turned into ChecksumMismatchError by fill()."""

    def __init__(self, fpath: str, task, b: int, block: int, got: int) -> None:
        super().__init__(fpath)
        self.fpath, self.fqn, self.block_index, self.got = fpath, task.fqn, b, got
        self.expected = task.chunk.crcs[b]
        self.offset = task.chunk.offset + b * block


def _copy(seg: _Segment, buf: torch.Tensor) -> None:
    for u in seg.units:
        t = u.task
        x = u.at - seg.offset + (u.start - u.lo)
        if u.flat is not None:
            dest_u8 = u.flat.reshape(-1).view(torch.uint8)
            dest_u8[u.dest_off:u.dest_off + u.end - u.start].copy_(buf[x:x + u.end - u.start])
            continue
        flat = buf[x:x + u.end - u.start]
        if x % t.itemsize:  # unaligned in the file (a DCP checkpoint packs chunks tight)
            flat = flat.clone()
        flat = flat.view(t.dtype)
        # as_strided's offset is absolute in the storage: keep the slice's own offset. The slice
        # starts at the box's first element, in any dense layout (every stride is >= 0).
        strides = t.chunk.strides if t.chunk.strides is not None else row_major_strides(t.chunk.sizes)
        src = flat.as_strided(tuple(u.box.sizes), tuple(strides), flat.storage_offset())
        dest = t.dest
        for d, (o, base, s) in enumerate(zip(u.box.offsets, t.dest_box.offsets, u.box.sizes)):
            dest = dest.narrow(d, o - base, s)
        dest.copy_(src)


def _workers(paths: Mapping[int, str]) -> int:
    """Worker threads for a fill of ``paths``: WORKERS, but no more than the CPUs this process may
    run on (at least 2) when every file is local. Why: local reads are CPU work once the bytes are
    cached or the disk is fast (a copy out of the page cache, crc32c, a strided copy_ that itself
    runs on torch's threads), and more threads than CPUs only take turns; each worker keeps its
    segment's READ_PIECE requests in flight together, so 2 of them still keep 8 MiB queued on a
    cold disk. Measured on the project's 2-core VM (docs/BENCHMARKS.md, "A DCP checkpoint of a
    channels_last model"): a load of strided boxes took 0.153-0.160 s with 2 workers against
    0.166-0.180 s with 4, warm; 0.416 against 0.430 s cold. Object-store reads wait on the network,
    not the CPU: they keep WORKERS."""
    if any(is_url(p) for p in paths.values()):
        return WORKERS
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or WORKERS
    return min(WORKERS, max(2, cpus))


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc keeps freed arenas' pages otherwise, so a
    load's short-lived allocations would still count in RSS after it returned)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _unmap(mm: mmap.mmap) -> None:
    """Unmap ``mm`` unless a buffer of it is still exported: then it is unmapped when the last
    export goes. A C reader keeps its call's buffer exported for ever once a read outlived its
    deadline and its cancel (csrc/reader.c, wedged), so that the kernel never writes into memory
    that was unmapped and reused; the load's own typed error is what the caller must see."""
    try:
        mm.close()
    except BufferError:
        pass


class _Buffer:
    """One page-aligned anonymous mapping, as a uint8 tensor and a memoryview."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.mm = mmap.mmap(-1, size)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.view = memoryview(self.mm)

    def close(self) -> None:
        self.tensor = None
        self.view.release()
        _unmap(self.mm)


class _Session:
    """Worker threads and bounce buffers for the fills of one load (see :func:`reading`).

    With ``keep_open`` it also keeps, from one fill to the next, the C pipeline's bounce slots
    and up to ``MAX_OPEN_READERS`` pipeline readers (LRU), whose slots stay registered with their
    rings (csrc/reader.c): a fill then sets up no ring, registers nothing and maps nothing. The
    slots and the workers' buffers still never exist at once (taking a worker buffer unmaps the
    slots, closing the readers that hold them first)."""

    def __init__(self, keep_open: bool = False) -> None:
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._idle: list[_Buffer] = []
        self.keep_open = keep_open
        self._readers: dict[str, Any] = {}    # path -> open pipeline reader, least recently used first
        self._slots: mmap.mmap | None = None

    def reader(self, path: str, open_reader: Callable[[str], Any]) -> Any:
        """The kept reader of ``path`` (opened now if it has none or it closed after an error)."""
        r = self._readers.pop(path, None)
        if r is None or r.closed:
            r = open_reader(path)
        self._readers[path] = r
        while len(self._readers) > MAX_OPEN_READERS:
            oldest = next(iter(self._readers))
            self._readers.pop(oldest).close()
        return r

    def slots(self, size: int, before_map: Callable[[], None]) -> mmap.mmap:
        """The kept slot mapping of ``size`` bytes (a mapping of another size is unmapped first)."""
        if self._slots is not None and len(self._slots) != size:
            self.drop_slots()
        if self._slots is None:
            before_map()
            self._slots = mmap.mmap(-1, size)
        return self._slots

    def drop_slots(self) -> None:
        """Close the kept readers (they hold the slots registered), then unmap the slots. One
        thread at a time (the workers' :meth:`take` all call it): a second caller waits until the
        first has closed every reader, else it would unmap the slots under a reader still
        holding them (BufferError)."""
        with self._lock:
            readers, self._readers = self._readers, {}
            for r in readers.values():
                r.close()
            slots, self._slots = self._slots, None
            if slots is not None:
                _unmap(slots)

    def submit(self, fn: Callable[[], None], n: int) -> list[concurrent.futures.Future]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="distckpt-read")
        return [self._pool.submit(fn) for _ in range(n)]

    def take(self, size: int, keep_slots: bool = False) -> _Buffer:
        """An idle buffer of at least ``size`` bytes, or a new one (an idle smaller one is unmapped
        first: at most one buffer per worker exists). Kept slots are unmapped first, unless
        ``keep_slots`` (the one worker of a :func:`side_reads` fill, whose buffer of about
        ``SIDE_SEGMENT`` fits the budget beside them: a conversion of an incremental chain reads
        each slice's delta rows that way, and unmapping the slots there cost their mapping and
        registration again at every slice)."""
        if not keep_slots:
            self.drop_slots()
        with self._lock:
            for i, b in enumerate(self._idle):
                if b.size >= size:
                    return self._idle.pop(i)
            small = self._idle.pop() if self._idle else None
        if small is not None:
            small.close()
        return _Buffer(size)

    def give(self, buf: _Buffer) -> None:
        with self._lock:
            self._idle.append(buf)

    def drop_idle(self) -> None:
        """Unmap the idle buffers (between two fills of the block; taken again when needed)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for b in idle:
            b.close()

    def close(self) -> None:
        """Join the threads, close the kept readers and unmap the buffers; the session can be used
        again afterwards."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.drop_slots()
        with self._lock:
            idle, self._idle = self._idle, []
        for b in idle:
            b.close()


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("distckpt_read_session", default=None)
_SIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("distckpt_side_reads", default=False)


@contextlib.contextmanager
def side_reads() -> Iterator[None]:
    """Run the :func:`fill` calls made inside the block (in this thread) with ``SIDE_SLOTS`` pipeline
    slots, one worker and segments of ``SIDE_SEGMENT`` bytes (more when a checkpoint's checksum
    block is larger): about 2 MiB of bounce memory instead of 24, for reads that run on another
    thread beside a load's main pass."""
    token = _SIDE.set(True)
    try:
        yield
    finally:
        _SIDE.reset(token)


@contextlib.contextmanager
def reading(keep_open: bool = False) -> Iterator[None]:
    """Run the :func:`fill` calls made inside the block (in this thread) on one set of worker
    threads and bounce buffers, created at the first fill and released when the block exits
    (joined, unmapped, heap trimmed), whether it returns or raises. A load that reads in several
    passes (an incremental chain: row ids, then base and rows, then the rest) pays the threads'
    start and the buffers' first touch once. Nested blocks share the outermost one's (and its
    ``keep_open``).

    ``keep_open=True``: the C pipeline's slots and readers (at most ``MAX_OPEN_READERS`` files'
    fds and rings) are kept open from one fill to the next too, and closed when the block exits;
    for many small fills of the same files (a conversion reads slice by slice), where opening a
    ring, registering the slots and mapping them cost more than the read itself."""
    if _SESSION.get() is not None:
        yield
        return
    session = _Session(keep_open)
    token = _SESSION.set(session)
    try:
        yield
    finally:
        _SESSION.reset(token)
        session.close()
        _malloc_trim()


def _pipelined(seg: _Segment) -> bool:
    """True when every unit of ``seg`` is a flat copy into CPU memory (the C pipeline's memcpy)
    and nothing orders it after other tasks; strided boxes, device destinations and ordered
    segments (a chain's delta rows) go through the workers."""
    return not seg.deps and all(u.flat is not None and u.flat.device.type == "cpu" for u in seg.units)


def _pack(segs: list[_Segment], size: int, block: int, verify: bool):
    """The packed plan of _uring.Reader.fill for one file's segments, and per check the (task,
    block index) it verifies (to name a mismatch)."""
    seg_rec, chk_rec, cpy_rec, dst_rec = bytearray(), bytearray(), bytearray(), bytearray()
    meta: list[tuple[Any, int]] = []
    ncopies = 0
    for s in segs:
        c0, p0 = len(meta), ncopies
        for u in s.units:
            t = u.task
            base = u.at - s.offset
            if verify:
                crcs = t.chunk.crcs
                for b in range(u.lo // block, -(-u.hi // block)):
                    chk_rec += _CHECK.pack(base + b * block - u.lo, min(block, u.hi - b * block), crcs[b])
                    meta.append((t, b))
            if u.end > u.start:
                d = u.flat
                cpy_rec += _COPY.pack(u.dest_off, ncopies, base + u.start - u.lo, u.end - u.start, 0)
                dst_rec += _DEST.pack(d.data_ptr(), d.numel() * d.element_size())
                ncopies += 1
        seg_rec += _SEG.pack(s.offset, s.end - s.offset, min(s.end, size) - s.offset, c0, len(meta) - c0,
                             p0, ncopies - p0)
    return bytes(seg_rec), bytes(chk_rec), bytes(cpy_rec), bytes(dst_rec), meta


def _check_holds(path: str, segs: Sequence[_Segment], size: int) -> None:
    """Raise DataFileTruncatedError when the file at ``path``, ``size`` bytes as opened, ends
    before the bytes ``segs`` read: it shrank after its size was checked against the MANIFEST
    (rewritten, or a download still in progress). The read plan's arithmetic assumes it did
    not (a negative length packed for the C pipeline was a bare struct.error)."""
    need = max((u.at + u.hi - u.lo for seg in segs for u in seg.units), default=0)
    if need > size:
        from .errors import DataFileTruncatedError
        raise DataFileTruncatedError(f"{os.path.basename(path)} has {size} bytes, {need} needed: it shrank after "
                                     f"its size was checked (rewritten or replaced while it was read)", path=path,
                                     expected=need, found=size)


def _run_pipeline(path: str, segs: list[_Segment], reader, buf, slot: int, block: int, verify: bool,
                  outcome: "_Outcome") -> None:
    """Read, verify and copy ``segs`` of one file with the C pipeline; record what was copied and
    the first failure in ``outcome``."""
    try:
        _check_holds(path, segs, reader.size)
    except DistCkptError as exc:
        outcome.fail(exc)
        return
    seg_rec, chk_rec, cpy_rec, dst_rec, meta = _pack(segs, reader.size, block, verify)
    done = bytearray(len(segs))
    try:
        bad = reader.fill_segments(buf, slot, seg_rec, chk_rec, cpy_rec, dst_rec, done)
    except BaseException as exc:  # noqa: BLE001 - raised by fill() with what was filled
        outcome.fail(exc)
        bad = None
    for s, ok in zip(segs, done):
        if ok == 1:
            outcome.copied([u.task.fqn for u in s.units], min(s.end, reader.size) - s.offset)
        elif ok == 2:   # read straight into its destinations (no checks), then failed: partly
            outcome.touch([u.task.fqn for u in s.units])
    if bad is not None:
        _, k, got = bad
        t, b = meta[k]
        outcome.fail(_Bad(path, t, b, block, got))


def _pipeline(paths: Mapping[int, str], plans: list[list[_Segment]], open_reader, bufsize: int,
              blocks: Mapping[int, int], verify: bool, outcome: "_Outcome",
              before_map: Callable[[], None] = lambda: None, nslots: int = PIPELINE_SLOTS,
              keep: _Session | None = None) -> list[_Segment]:
    """Run every segment the C pipeline can take (see :func:`_pipelined`), one file at a time in
    this thread, through ``nslots`` slots of ``bufsize`` bytes (mmapped here, unmapped
    before returning; with ``keep``, a keep_open session, its kept slots and readers, left open).
    Returns the segments left for the workers: strided or device ones, and all
    of a file whose reader has no ``fill_segments`` (an object store, the buffered backend)."""
    if keep is not None:
        return _pipeline_kept(paths, plans, open_reader, bufsize, blocks, verify, outcome, before_map, nslots, keep)
    rest: list[_Segment] = []
    mm = None
    try:
        for segs in plans:
            mine = _take_pipelined(segs, rest)
            if not mine or outcome.failed():
                continue
            path = paths[mine[0].file_index]
            try:
                reader = open_reader(path)
            except BaseException as exc:  # noqa: BLE001 - raised by fill() with what was filled
                outcome.fail(exc)
                break
            try:
                if not getattr(reader, "supports_fill", False):
                    rest.extend(mine)
                    continue
                if mm is None:
                    before_map()
                    mm = mmap.mmap(-1, nslots * bufsize)
                _run_pipeline(path, mine, reader, mm, bufsize, blocks[mine[0].file_index], verify, outcome)
            finally:
                reader.close()
            if outcome.failed():
                break
    finally:
        if mm is not None:
            _unmap(mm)
    return rest


def _take_pipelined(segs: list[_Segment], rest: list[_Segment]) -> list[_Segment]:
    """The segments of one file the C pipeline reads; the others are appended to ``rest``."""
    rest.extend(s for s in segs if not _pipelined(s))
    return [s for s in segs if _pipelined(s)]


def _pipeline_kept(paths, plans, open_reader, bufsize, blocks, verify, outcome, before_map, nslots,
                   keep: _Session) -> list[_Segment]:
    """:func:`_pipeline` on a keep_open session's slots and readers (not closed here; a reader
    that failed closed itself and is reopened by the next fill)."""
    rest: list[_Segment] = []
    for segs in plans:
        mine = _take_pipelined(segs, rest)
        if not mine or outcome.failed():
            continue
        path = paths[mine[0].file_index]
        try:
            reader = keep.reader(path, open_reader)
        except BaseException as exc:  # noqa: BLE001 - raised by fill() with what was filled
            outcome.fail(exc)
            break
        if not getattr(reader, "supports_fill", False):
            rest.extend(mine)
            continue
        mm = keep.slots(nslots * bufsize, before_map)
        if reader.closed:  # slots of another size were mapped: that closed the kept readers
            try:
                reader = keep.reader(path, open_reader)
            except BaseException as exc:  # noqa: BLE001 - raised by fill() with what was filled
                outcome.fail(exc)
                break
        _run_pipeline(path, mine, reader, mm, bufsize, blocks[mine[0].file_index], verify, outcome)
        if outcome.failed():
            break
    return rest


def fill(paths: Mapping[int, str], by_file: dict[int, list[Any]], *, block: int | Mapping[int, int],
         verify: bool, open_reader: Callable[[str], Any], align: int, exchange: Any = None) -> FillStats:
    """Read, verify and copy every task's bytes. ``paths[i]`` is the path of data file ``i``; ``by_file`` maps
    a file index to its tasks (:class:`Task`: fqn, chunk, inter, dest, dest_box, itemsize,
    dtype, and ``after``: None, or the fqn of tasks of this call that must be copied first);
    ``block`` is the checksum block of every file, or a map from file index to the block of that
    file's checkpoint (files of several checkpoints read in one pass);
    ``open_reader(path)`` opens a :class:`distckpt.storage.posix.Reader` (one per worker and file).
    ``exchange``: a :class:`distckpt.readonce.Exchange` (collective: every rank of its group fills
    with it, or joins it otherwise): the segments other ranks need too are read once in the job
    and moved between ranks first (verified on arrival, recorded like a read), then the rest is read.

    Raises:
        ChecksumMismatchError: a block differs from its checksum; nothing of the segment holding it
            reached the caller. Fields ``filled`` (keys whose tensors were filled completely) and
            ``partly_filled`` (keys with some verified bytes copied, the rest as they were).
        DataFileTruncatedError, StorageError subclasses: from the reader, with the same two fields.
    """
    stats = FillStats()
    side = _SIDE.get()
    segment = SIDE_SEGMENT if side else SEGMENT
    blocks = dict(block) if isinstance(block, Mapping) else {fi: block for fi in by_file}
    # A verified unit spans whole blocks, but never more than its chunk (the last block is
    # partial): the buffers are sized by that, not by the block alone, so a checkpoint whose
    # block is far larger than its chunks (up to manifest.MAX_CHECKSUM_BLOCK) maps no more than
    # its chunks need.
    spans = [min(blocks[fi], max((t.chunk.nbytes for t in by_file[fi]), default=0)) for fi in by_file]
    limit = max([segment, *spans]) if verify else segment
    bufsize = _align_up(limit + 2 * align, mmap.PAGESIZE)
    counts: dict[str, int] = {}
    segments: list[_Segment] = []
    for fi in sorted(by_file):
        segs = plan_segments(fi, by_file[fi], block=blocks[fi], verify=verify, align=align, segment=limit)
        segments.extend(segs)
        for s in segs:
            for u in s.units:
                counts[u.task.fqn] = counts.get(u.task.fqn, 0) + 1
        for t in by_file[fi]:
            stats.bytes_needed += t.inter.volume * t.itemsize
    # Dependencies only on tasks that have none themselves: those are free segments, so a worker
    # waiting for them always sees them finish (or fail).
    firsts = {t.fqn for ts in by_file.values() for t in ts if getattr(t, "after", None) is None}
    for s in segments:
        deps = {u.task.after for u in s.units if getattr(u.task, "after", None) is not None}
        s.deps = frozenset(deps & firsts)
    outcome = _Outcome(counts, [])
    if exchange is not None:
        # Before this fill maps its slots or buffers: the exchange's own are released by then.
        segments = exchange.run(segments, outcome, paths, open_reader, blocks, verify, bufsize)
        if outcome.error is not None:
            raise _typed(outcome)
    session = _SESSION.get()
    own = session is None
    if own:
        session = _Session()
    # The C pipeline first (segments without dependencies, in this thread); what it cannot take
    # goes to the workers, after it: a segment ordered after a pipelined task finds it copied.
    plans = [[s for s in segments if s.file_index == fi] for fi in sorted(by_file)]
    nslots = SIDE_SLOTS if side else PIPELINE_SLOTS
    if not session.keep_open:
        # Slots and bounce buffers as large as this fill's largest segment and no more of them
        # than a file has segments: a read of a few small values (a step counter, a scheduler's
        # state) mapped, faulted in, registered and unmapped 6 x 4 MiB before, 30-60 ms per read.
        # (A keep_open session keeps one size for all its fills: remapping closes its readers.)
        biggest = max((s.end - s.offset for s in segments), default=0)
        bufsize = min(bufsize, _align_up(max(biggest, 1), max(mmap.PAGESIZE, align)))
        nslots = max(1, min(nslots, max(map(len, plans), default=1)))
    # The slots are mapped only while no worker buffer is: a session's idle ones are unmapped first.
    rest = _pipeline(paths, plans, open_reader, bufsize, blocks, verify, outcome, before_map=session.drop_idle,
                     nslots=nslots, keep=session if session.keep_open else None)
    if outcome.error is not None:
        stats.bytes_read, stats.segments = outcome.bytes_read, outcome.segments
        if own:
            session.close()
            _malloc_trim()
        raise _typed(outcome)
    outcome.queue(rest)
    nworkers = 1 if side else max(1, min(_workers(paths), len(rest)))

    def work() -> None:
        bounce = session.take(bufsize, keep_slots=side)
        buf, view = bounce.tensor, bounce.view
        readers: dict[int, Any] = {}
        try:
            while True:
                seg = outcome.next()
                if seg is None:
                    break
                reader = readers.get(seg.file_index)
                if reader is None:
                    for r in readers.values():  # files are planned in order: done with the last one
                        r.close()
                    readers.clear()
                    reader = readers[seg.file_index] = open_reader(paths[seg.file_index])
                _check_holds(paths[seg.file_index], [seg], reader.size)
                n = min(seg.end, reader.size) - seg.offset
                reader.read_into([(seg.offset, n, view[:seg.end - seg.offset])])
                if verify:
                    verify_read(reader, paths[seg.file_index], seg, n, view, blocks[seg.file_index])
                if outcome.failed():  # another worker failed: copy nothing more
                    break
                with torch.no_grad():
                    _copy(seg, buf)
                outcome.copied([u.task.fqn for u in seg.units], n)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            traceback.clear_frames(exc.__traceback__)  # drop views of the buffer held by frames
            outcome.fail(exc)
        finally:
            for r in readers.values():
                r.close()
            del buf, view
            session.give(bounce)

    try:
        if rest:
            for f in session.submit(work, nworkers):
                f.result()
    finally:
        if own:
            session.close()
            _malloc_trim()
    stats.bytes_read, stats.segments = outcome.bytes_read, outcome.segments
    if outcome.error is not None:
        raise _typed(outcome)
    return stats


def _typed(outcome: _Outcome) -> BaseException:
    full, part = outcome.filled()
    exc = outcome.error
    said = (f"; already filled with verified checkpoint bytes: {len(full)} tensor(s) {full[:10]}, "
            f"partly: {len(part)} {part[:10]}; every other byte of the state dict is as it was")
    if isinstance(exc, _Bad):
        name = os.path.basename(exc.fpath)
        return ChecksumMismatchError(
            f"checksum mismatch in {name} at byte {exc.offset} (block {exc.block_index} of key "
            f"{exc.fqn!r}): expected {exc.expected:#010x}, found {exc.got:#010x}; no byte of that block "
            f"reached the state dict" + said,
            path=exc.fpath, file=name, key=exc.fqn, offset=exc.offset, filled=full, partly_filled=part)
    if isinstance(exc, DistCkptError):
        exc.filled, exc.partly_filled = full, part
        exc.details.update(filled=full, partly_filled=part)
    return exc


# ------------------------------------------------------------------------------------------------
# Fills of planned tasks over one or several checkpoints


@dataclasses.dataclass
class Task:
    """One saved chunk's intersection with one destination box: what :func:`fill` reads."""

    fqn: str
    chunk: Any            # manifest.ChunkRecord
    inter: Box            # global box to copy
    dest: Any             # the destination holding dest_box (a tensor, or a scatter, see fill_boxes_of)
    dest_box: Box
    itemsize: int
    dtype: torch.dtype
    after: str | None = None   # copied only after every task of that fqn (see fill)


@dataclasses.dataclass
class Part:
    """The tasks of one checkpoint in a fill: ``store`` serves the data files of the checkpoint
    at ``path`` whose manifest is ``manifest``."""

    store: Any            # distckpt.storage.Store
    path: str
    manifest: Any         # manifest.Manifest
    tasks: list[Task]


def fill_parts(parts: Sequence[Part], *, verify: bool, exchange: Any = None) -> tuple[int, str | None]:
    """Read, verify and copy the tasks of every part in one pass over their files, each file
    verified with its own checkpoint's checksum block (a DCP or Hugging Face checkpoint, which has
    none, in a pass of its own: nothing to verify). A task's ``after`` may name an fqn of another
    part's tasks. Every data file is checked against its manifest (the store's ``data_readers``)
    before the first byte is read, so a missing or truncated file fails with every destination
    untouched. Returns (file bytes read, backend of the first part with tasks, or None).
    ``exchange`` (a load's read-once exchange, see :func:`fill`) is used by the pass over the
    checksummed files when every task is of one part (file keys are then the manifest's, the same
    on every rank); otherwise the caller joins it afterwards.

    Raises the errors of :func:`fill` (their ``path`` names the data file) and of the stores'
    ``data_readers``, each with ``filled`` / ``partly_filled`` for all the parts together."""
    passes: list = []   # the keys each fill of _fill_parts writes, in order; then how many completed
    try:
        return _fill_parts(parts, verify, exchange, passes)
    except DistCkptError as exc:
        _say_what_was_filled(exc, passes)
        raise


def _say_what_was_filled(exc: DistCkptError, passes: list) -> None:
    """Set ``exc``'s ``filled`` / ``partly_filled`` for the whole of :func:`fill_parts` (a fill
    names only what it wrote itself): the keys of the fills that completed, with the failing
    fill's own lists; a key that a fill which never ran also writes is only partly filled. An
    error before any byte moved (a data file's size check) says so: both lists empty."""
    keys, ran = (passes[:-1], passes[-1]) if passes else ([], 0)
    done = set().union(*keys[:ran])
    failing = keys[ran] if ran < len(keys) else set()
    pending = set().union(*keys[ran + 1:])
    own_filled = set(getattr(exc, "filled", None) or ())
    own_partly = set(getattr(exc, "partly_filled", None) or ())
    touched = done | own_filled | own_partly
    filled = {k for k in touched if k not in own_partly and k not in pending and (k in own_filled or k not in failing)}
    exc.filled, exc.partly_filled = sorted(filled), sorted(touched - filled)
    exc.details.update(filled=exc.filled, partly_filled=exc.partly_filled)


def _fill_parts(parts: Sequence[Part], verify: bool, exchange: Any, passes: list) -> tuple[int, str | None]:
    paths: dict[int, str] = {}
    by_file: dict[int, list[Task]] = {}
    blocks: dict[int, int] = {}
    openers: dict[str, Callable[[str], Any]] = {}
    unchecked = []   # (paths, tasks by file, block, open_reader, align) of parts without checksums
    align, backend = 1, None
    for pi, part in enumerate(parts):
        own: dict[int, list[Task]] = {}
        for t in part.tasks:
            own.setdefault(t.chunk.file, []).append(t)
        if not own:
            continue
        fpaths, open_reader, falign, fbackend = part.store.data_readers(part.path, part.manifest, sorted(own),
                                                                        piece=READ_PIECE)
        backend = backend or fbackend
        if part.manifest.checksum_algo != "crc32c":
            # A DCP chunk's place inside its torch.save archive is found for the chunks read only,
            # now, before any byte moves: a malformed archive fails with every destination as it was.
            resolve_chunks([t.chunk for ts in own.values() for t in ts])
            unchecked.append((fpaths, own, part.manifest.checksum_block, open_reader, falign))
            continue
        align = max(align, falign)
        for fi, tasks in own.items():
            key = (pi << 32) | fi   # unique across parts, in the order of the parts
            paths[key], by_file[key], blocks[key] = fpaths[fi], tasks, part.manifest.checksum_block
            openers[fpaths[fi]] = open_reader
    nbytes = 0
    passes += [{t.fqn for ts in own.values() for t in ts} for _p, own, _b, _o, _a in unchecked]
    if by_file:
        passes.append({t.fqn for ts in by_file.values() for t in ts})
    passes.append(0)   # how many of them completed
    for fpaths, own, block, open_reader, falign in unchecked:
        nbytes += fill(fpaths, own, block=block, verify=False, align=falign, open_reader=open_reader).bytes_read
        passes[-1] += 1
    if by_file:
        one_part = len({key >> 32 for key in by_file}) == 1
        nbytes += fill(paths, by_file, block=blocks, verify=verify, align=align,
                       open_reader=lambda p: openers[p](p), exchange=exchange if one_part else None).bytes_read
    return nbytes, backend


def box_tasks(path: str, manifest: Any, requests: Sequence[tuple]) -> list[Task]:
    """The tasks that read box requests of the checkpoint at ``path``: each request is
    ``(fqn, offsets, sizes, destination[, after])``, the destination a tensor of the box's shape
    or an object with the tensor methods a fill uses on one (``dtype``, ``is_contiguous()``,
    ``narrow()``, ``copy_()``: distckpt.incremental scatters a delta's rows straight from the
    read buffers into a table that way). Raises ManifestCorruptError for a dtype the manifest
    names but torch lacks."""
    tasks = []
    for req in requests:
        fqn, offsets, sizes, out = req[:4]
        after = req[4] if len(req) > 4 else None
        entry = manifest.tensors[fqn]
        dtype = dtype_from_name(entry.dtype, path=path)
        want = Box(tuple(offsets), tuple(sizes))
        if want.volume:
            chunks = [(Box(tuple(c.offsets), tuple(c.sizes)), c) for c in entry.chunks]
            tasks.extend(Task(fqn, rp.payload, rp.box, out, want, dtype.itemsize, dtype, after)
                         for rp in plan_reads(chunks, want, itemsize=dtype.itemsize))
    return tasks


def fill_boxes_of(checkpoints: Sequence[tuple[str, Any, Sequence[tuple]]], *, verify: bool = True) -> int:
    """Read box requests of several checkpoints ``(path, manifest, requests)`` (requests as
    :func:`box_tasks` takes them; ``path`` local, or a URL whose store needs no options) in one
    read pass (:func:`fill_parts`): the pipeline's fixed costs are paid once, not per checkpoint.
    Returns the bytes read. Raises the read errors of :func:`distckpt.load`; their ``path`` names
    the data file."""
    return fill_parts([Part(open_store(path), path, manifest, box_tasks(path, manifest, requests))
                       for path, manifest, requests in checkpoints], verify=verify)[0]
