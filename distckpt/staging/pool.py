"""Host staging memory of async saves: aligned host segments (pinned when CUDA is available) that
an async save copies its pieces into, kept for the next save, reserved ahead of the first one.

Why segments and a background reservation: the first async save of a job used to allocate one
arena of its state's size on the caller's critical path. Pinning GiBs (cudaHostAlloc, through
torch's caching host allocator, which also rounds every request up to a power of two) took 2-5 s
on an H100/H200, and on a CPU host the first copy faulted in every page of a fresh arena (0.8 s
per GiB on a 2-core VM), while later saves blocked 0.05-0.2 s. Now:

  * :func:`reserve_staging_memory` prepares the memory a state will need on a background thread
    (allocated, every page faulted in, pinned by ``cudaHostRegister`` at its exact size when CUDA
    is available), so the first save finds it ready.
  * A save never allocates pinned memory on the caller's path: pieces go into the idle segments
    that fit them, and what does not fit goes into one fresh pageable overflow segment (a plain
    allocation: no pinning). After the save the pool keeps the overflow segment (CPU hosts) or
    reserves a pinned segment of its size in the background (CUDA hosts), so the next save of the
    same state stages without overflow: a state that grows (optimizer states created at the first
    step) costs one slower save, never a pinning stall.

Invariants:
  * Bounded: the segments in use by the save in flight (at most one: saves are serialized), plus
    the idle and reserving segments, whose total DISTCKPT_STAGING_POOL_BYTES caps (0: keep none,
    reserve none); :func:`release_staging_memory` frees the idle ones now. After a save, idle
    segments it did not use are freed (the state shrank), and the pool never keeps more than twice
    the last save's bytes plus 1 MiB. One copy of a state's fit, not two: a save that needs an
    overflow segment while a reservation is still being prepared supersedes it (using the
    segments it already made), and a reservation counts the segments of a save in flight as
    there; so a reservation right before or during a save does not leave its segments beside the
    save's own (``StagingPool.held_bytes``: everything the pool holds).
  * Large pieces start at 4 KiB boundaries, so the O_DIRECT writer can write them without another
    copy.
  * After :func:`stage` returns, every staged piece points at its copy: changing the caller's
    tensors no longer changes what is written.
  * A pinned segment is unregistered before its memory is freed; a reservation that fails to pin
    (RLIMIT_MEMLOCK, no driver) keeps the memory pageable and logs why, once: correct, slower.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from typing import Any

import torch

from ..config import get_config
from ..errors import HostMemoryError, from_os_error

__all__ = ["StagingPool", "StagingReservation", "staging_pool", "release_staging_memory",
           "reserve_staging_memory", "stage", "staging_started", "staging_ended", "wait_for_staging"]

log = logging.getLogger("distckpt")

# Pieces of at least this many bytes start on a page boundary (O_DIRECT can write them in place);
# smaller ones only on a cache line (the writer copies small writes into its staging anyway).
_PAGE = 4096
_BIG = 64 << 10
_SMALL_ALIGN = 64
_SLACK = 1 << 20  # a pool may keep 2 x the last save's bytes plus this
_HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB base pages)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _piece_align(n: int) -> int:
    return _PAGE if n >= _BIG else _SMALL_ALIGN


# Segments are at most this large unless one piece is larger (it gets a segment of its own size):
# pinning is one cudaHostRegister call per segment, and the driver holds a lock through the call
# that stalls the training thread's CUDA calls (2 GiB in one call: a 0.6 s stall on an H200).
_CHUNK = 64 << 20


def _place(sizes: list[int], caps: list[int]) -> tuple[list[tuple[int, int] | None], list[int]]:
    """First fit decreasing: place pieces of ``sizes`` (visited largest first, ties in order) into
    segments of capacities ``caps`` (tried in order). Returns each piece's (segment index, offset),
    None for a piece that fits nowhere, and each segment's used bytes. Deterministic, so the same
    sizes placed over segments :func:`_pack` made for them fit exactly as packed."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    cursors = [0] * len(caps)
    open_ = list(range(len(caps)))  # segments with room for at least a small piece
    places: list[tuple[int, int] | None] = [None] * len(sizes)
    for i in order:
        n = sizes[i]
        if n == 0:  # an empty view: any segment's start
            places[i] = (0, 0) if caps else None
            continue
        align = _piece_align(n)
        for j in open_:
            off = _round_up(cursors[j], align)
            if off + n <= caps[j]:
                cursors[j] = off + n
                places[i] = (j, off)
                if caps[j] - cursors[j] < _SMALL_ALIGN:
                    open_.remove(j)
                break
    return places, cursors


def _pack(sizes: list[int]) -> list[int]:
    """Segment capacities that hold pieces of ``sizes`` as :func:`_place` places them: segments of
    up to _CHUNK, and a segment of its own for a piece larger than that."""
    order = sorted((n for n in sizes if n > 0), reverse=True)
    caps: list[int] = []
    cursors: list[int] = []
    for n in order:
        align = _piece_align(n)
        for j, c in enumerate(cursors):  # the same first fit as _place, over the bins so far
            if _round_up(c, align) + n <= caps[j]:
                cursors[j] = _round_up(c, align) + n
                break
        else:
            caps.append(_round_up(n, _PAGE) if n > _CHUNK else _CHUNK)
            cursors.append(n)
    # Trim each segment to what it holds: _place then finds the same fit (a piece that did not fit
    # a segment untrimmed does not fit it trimmed, at the same cursor; one that did still does).
    return [_round_up(cur, _PAGE) for cur in cursors]


_PIN_WARNED = False


def _cudart():
    return torch.cuda.cudart()


def _mapping(nbytes: int, *, huge: bool) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` (page-aligned, zero-filled); with ``huge`` it
    asks for transparent huge pages before its first touch.

    Why huge pages for segments reserved ahead: the kernel pins an O_DIRECT request's pages one by
    one, and the save's writes run from these segments: the C writer wrote 1.5-1.6x faster from
    2 MiB pages than from 4 KiB ones on the project's VM (docs/BENCHMARKS.md, "Huge pages"), and
    faulting in or pinning (cudaHostRegister) walks 512x fewer pages. Why not for the overflow
    segment faulted in by a save's copy on the caller's path: on a VM whose host backs guest
    memory lazily a fresh huge page costs several times more to touch first (with the overflow
    asking too, the first unreserved save there blocked 1.65-1.86 s against 0.64-0.72 s); a
    reservation pays that in the background, once, for memory kept across saves.
    Most kernels give huge pages only to memory that asks (``madvise`` mode); where THP is off,
    the request is refused and the memory is 4 KiB pages, as correct and only slower.
    ``mmap.mmap(-1, n)`` alone would map shared memory (shmem: no huge pages there).
    Raises HostMemoryError (ENOMEM: no memory or address space left for it)."""
    try:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise HostMemoryError(f"staging memory: mapping {nbytes} bytes failed: [Errno {exc.errno}] "
                                  f"{exc.strerror}", needed=nbytes, errno=exc.errno) from exc
        raise from_os_error(exc, operation="mmap") from exc
    if huge and nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # EINVAL: a kernel built without transparent huge pages
            pass
    return mm


class Segment:
    """One page-aligned host buffer of ``capacity`` bytes; pinned (registered with the CUDA driver
    at its exact size) when ``pinned``. ``prefault`` (a segment reserved ahead) asks for huge pages
    and touches every page now, so copies into it do not fault (:func:`_mapping` says why only
    then)."""

    def __init__(self, capacity: int, *, pin: bool, prefault: bool) -> None:
        global _PIN_WARNED
        self.capacity = capacity
        # A mapping of its own; the tensor holds it, so it is unmapped when the last view of
        # ``buf`` is gone (as torch memory is freed), never under a view still in use.
        self.buf = (torch.frombuffer(_mapping(capacity, huge=prefault), dtype=torch.uint8) if capacity
                    else torch.empty(0, dtype=torch.uint8))
        self.pinned = False
        if pin and capacity:
            # cudaHostRegister faults in and locks every page itself (without the GIL).
            err = _cudart().cudaHostRegister(self.buf.data_ptr(), capacity, 0)
            if int(err) == 0:
                self.pinned = True
            elif not _PIN_WARNED:
                _PIN_WARNED = True
                log.warning("distckpt: cudaHostRegister of %d bytes of async staging memory failed "
                            "(cudaError %d; RLIMIT_MEMLOCK?): device copies into it are not DMAs",
                            capacity, int(err))
        if prefault and not self.pinned and capacity:
            # Zero it all: a page-strided fill would fault the same pages but runs 3-4x slower
            # (one thread, one fault at a time); zero_ is a parallel memset.
            self.buf.zero_()

    def free(self) -> None:
        """Unpin (if pinned) and drop this segment's memory reference. Idempotent."""
        if self.pinned:
            self.pinned = False
            try:
                _cudart().cudaHostUnregister(self.buf.data_ptr())
            except Exception as exc:  # noqa: BLE001 - the memory is freed either way
                log.warning("distckpt: cudaHostUnregister failed: %s", exc)
        self.buf = None

    def __del__(self) -> None:
        # At interpreter exit torch.cuda may be gone, and the process's pages go with it anyway.
        if getattr(self, "pinned", False) and not sys.is_finalizing():
            self.free()


class Arena:
    """The segments one save staged into: ``used`` maps each segment to the bytes it holds."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.used: dict[int, int] = {}  # id(segment) -> bytes laid out in it
        self.overflow: Segment | None = None
        self.overflow_sizes: list[int] = []  # the pieces that did not fit the idle segments


class StagingReservation:
    """Staging memory being prepared in the background by :func:`reserve_staging_memory`."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.error: BaseException | None = None
        #: True when :func:`release_staging_memory` (the pool's ``clear``) stopped it: what it had
        #: prepared is freed, the rest never allocated.
        self.superseded = False
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the memory is ready (or its allocation failed: see ``error``). Returns
        whether it finished within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def __repr__(self) -> str:
        state = ("pending" if not self.done() else "failed" if self.error is not None
                 else "superseded" if self.superseded else "ready")
        return f"StagingReservation({self.nbytes} bytes, {state})"


class StagingPool:
    """Aligned host staging segments reused across async saves of one process (see the module's
    docstring for the bounds). Thread-safe: saves take and give back segments on different
    threads, reservations fill the pool from their own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[Segment] = []
        self._pending = 0  # bytes of reservations still being prepared
        # Bytes of the segments handed to a save by take() and not yet given back by release():
        # memory the pool will get back, so a reservation made meanwhile counts it as there.
        self._in_use = 0
        # Bumped by clear(): a reservation prepared under an older generation is superseded (its
        # worker frees what it makes instead of adding it, and stops).
        self._generation = 0
        self.allocations = 0  # segments allocated so far (tests / benchmarks: reuse is visible)
        # Segments inherited from the parent by a forked child: referenced forever, never freed
        # or reused (see _forget_after_fork).
        self._inherited: list[Segment] = []
        _POOLS.add(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: start empty, with a fresh lock. The idle segments are the parent's
        (pinned ones registered with the parent's CUDA context, which the child must not call);
        the child keeps them referenced, so their ``__del__`` never runs, and never hands them to
        a save. Reservation threads do not exist in the child: nothing is pending."""
        self._lock = threading.Lock()
        self._inherited.extend(self._idle)
        self._idle = []
        self._pending = 0
        self._in_use = 0  # the parent's save in flight: its arena is not the child's
        self._generation += 1

    # -- reservations ------------------------------------------------------------------------
    def reserve(self, sizes: list[int], *, pin: bool | None = None) -> StagingReservation:
        """Prepare idle segments that hold pieces of ``sizes`` bytes (as :func:`_pack` packs them)
        on a background thread, each added to the pool as soon as it is ready. Cut (whole
        segments, the last packed first: the smallest pieces') so that idle, pending and new
        memory stay within DISTCKPT_STAGING_POOL_BYTES: nothing when the bound is 0."""
        if pin is None:
            pin = torch.cuda.is_available()
        caps = _pack([int(n) for n in sizes if n > 0])
        bound = get_config().staging_pool_bytes
        with self._lock:
            have = sum(s.capacity for s in self._idle) + self._pending
            if bound is not None:
                while caps and have + sum(caps) > bound:
                    caps.pop()
            total = sum(caps)
            res = StagingReservation(total)
            if total == 0:
                res._done.set()
                return res
            self._pending += total
            gen = self._generation

        def work() -> None:
            left = total
            try:
                for cap in caps:
                    with self._lock:
                        if self._generation != gen:  # released meanwhile: allocate no more
                            res.superseded = True
                            break
                    t0 = time.perf_counter()
                    seg = Segment(cap, pin=pin, prefault=True)
                    if pin:
                        # Pinning holds a driver lock that the training thread's CUDA calls wait
                        # on; a pause after each segment lets them through (no lock is fair).
                        time.sleep(min(0.05, max(0.002, (time.perf_counter() - t0) / 4)))
                    with self._lock:
                        self.allocations += 1
                        current = self._generation == gen
                        if current:
                            self._pending -= cap
                            left -= cap
                            self._idle.append(seg)
                    if not current:  # released while it was being made: "frees it now" holds
                        seg.free()
                        res.superseded = True
                        break
            except BaseException as exc:  # noqa: BLE001 - reported on the reservation, logged
                res.error = exc
                log.warning("distckpt: reserving %d bytes of async staging memory failed: %s: %s",
                            total, type(exc).__name__, exc)
            finally:
                with self._lock:
                    if self._generation == gen:  # (clear() already dropped a superseded one's)
                        self._pending -= left
                res._done.set()

        threading.Thread(target=work, name="distckpt-staging-reserve", daemon=True).start()
        return res

    # -- one save's arena --------------------------------------------------------------------
    def take(self, sizes: list[int]) -> tuple[Arena, list[tuple[Segment, int]]]:
        """Lay pieces of ``sizes`` bytes out over the idle segments (:func:`_place`: the fit they
        were reserved for) and one fresh pageable overflow segment for what does not fit. Returns
        the arena (its segments are no longer idle) and each piece's (segment, offset). Never
        pins, never waits.

        A reservation still being prepared when the save needs an overflow segment (a save right
        after :func:`reserve_staging_memory`, or right after a save whose overflow is being
        re-reserved pinned) is superseded: its segments already made are used here, the rest is
        never added (the segment in the making is freed once made; ``superseded`` on it). Why:
        otherwise its segments land in the pool beside this save's overflow, which holds the
        same pieces, and the pool kept both (2x the state, within its 2x + 1 MiB bound); waiting
        for it instead would put its allocation and pinning on the caller's path. After this
        save, the overflow is kept (CPU) or re-reserved pinned (CUDA), so the pool converges on
        one copy of what the state needs."""
        with self._lock:
            idle, self._idle = self._idle, []
            placed, cursors = _place(sizes, [seg.capacity for seg in idle])
            if self._pending and any(p is None for p in placed):
                self._generation += 1
                self._pending = 0
            self._in_use += sum(seg.capacity for seg in idle)
        arena = Arena()
        for seg, used in zip(idle, cursors):
            arena.segments.append(seg)
            arena.used[id(seg)] = used
        missing = [i for i, p in enumerate(placed) if p is None]
        places: list[tuple[Segment, int]] = [(idle[p[0]], p[1]) if p is not None else None  # type: ignore[misc]
                                             for p in placed]
        if missing:
            over_sizes = [sizes[i] for i in missing]
            # Laid out by the same first fit as every segment, so the next save's _place fits
            # these pieces into this segment exactly as here.
            over_places, (cursor,) = _place(over_sizes, [1 << 62])
            try:
                over = Segment(_round_up(cursor, _PAGE), pin=False, prefault=False)
            except BaseException:
                # Out of memory: the idle segments taken above go back (and out of _in_use), or
                # the pool would count them in use for good and never reserve again.
                self.release(arena, pin=False)
                raise
            with self._lock:
                self.allocations += 1
                self._in_use += over.capacity
            arena.overflow = over
            arena.segments.append(over)
            arena.overflow_sizes = over_sizes
            for i, p in zip(missing, over_places):
                places[i] = (over, p[1])
            arena.used[id(over)] = cursor
        return arena, places

    def release(self, arena: Arena | None, *, pin: bool | None = None) -> None:
        """Take ``arena``'s segments back after its save. Segments the save did not use are freed;
        an overflow segment is kept when it is already what the next save wants (no CUDA), else
        freed and pinned segments for its pieces reserved in the background; the pool then keeps
        at most DISTCKPT_STAGING_POOL_BYTES and at most 2 x the save's bytes + 1 MiB (segments in
        the order the next save tries them, the save's own first)."""
        if arena is None:
            return
        if pin is None:
            pin = torch.cuda.is_available()
        with self._lock:
            self._in_use = max(0, self._in_use - sum(seg.capacity for seg in arena.segments))
        used_total = sum(arena.used.values())
        keep: list[Segment] = []
        for seg in arena.segments:
            if arena.used.get(id(seg), 0) == 0:
                seg.free()
            elif seg is arena.overflow and pin:
                seg.free()  # pageable: replaced by pinned segments reserved below
            else:
                keep.append(seg)
        bound = get_config().staging_pool_bytes
        limit = 2 * used_total + _SLACK
        if bound is not None:
            limit = min(limit, bound)
        with self._lock:
            kept, total = [], 0
            for seg in keep + self._idle:
                if total + seg.capacity <= limit:
                    kept.append(seg)
                    total += seg.capacity
                else:
                    seg.free()
            self._idle = kept
            pending = self._pending
        if pin and arena.overflow is not None and pending == 0:
            # (A reservation still being prepared is an earlier overflow's, for the same pieces.)
            self.reserve(arena.overflow_sizes, pin=True)
        arena.segments.clear()
        arena.overflow = None

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(s.capacity for s in self._idle)

    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending

    def in_use_bytes(self) -> int:
        """Bytes of the segments a save in flight holds (given back to the pool when it ends)."""
        with self._lock:
            return self._in_use

    def held_bytes(self) -> int:
        """All the staging memory of this pool: idle, being reserved, and held by a save in
        flight."""
        with self._lock:
            return sum(s.capacity for s in self._idle) + self._pending + self._in_use

    def clear(self) -> int:
        """Free the idle segments (those of a save in flight are freed or kept when it ends) and
        supersede every reservation still being prepared: it adds nothing more to the pool, frees
        the segment it is making once made, and allocates no further one. Returns the idle bytes
        freed here."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._generation += 1
            self._pending = 0
        freed = sum(s.capacity for s in idle)
        for seg in idle:
            seg.free()
        return freed


# Every pool of this process (the process-wide one; tests make private ones), for the fork hook.
_POOLS: "weakref.WeakSet[StagingPool]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pool in list(_POOLS):
        pool._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_POOL = StagingPool()


def staging_pool() -> StagingPool:
    """The process-wide staging pool of async saves."""
    return _POOL


def release_staging_memory() -> int:
    """Give back the host memory async saves keep for reuse (the idle staging segments of this
    process), now. A reservation still being prepared (:func:`reserve_staging_memory`) stops: the
    segment it is making is freed as soon as it is made, nothing more is allocated
    (``StagingReservation.superseded``). An async save still in flight keeps its segments until
    it finishes (then they are kept again, within DISTCKPT_STAGING_POOL_BYTES, unless released
    once more). Returns the bytes freed. The next async save stages through a plain allocation
    (see :func:`reserve_staging_memory` to have it ready)."""
    return _POOL.clear()


def _local_tensor_bytes(state_dict: Any) -> list[int]:
    """The size of each of this rank's local tensor pieces in ``state_dict`` (DTensor /
    ShardedTensor: local shards): an upper bound of what this rank stages (a replicated tensor is
    written by one rank)."""
    from ..flatten import TensorItem, flatten
    _tree, items = flatten(state_dict)
    sizes = []
    for item in items.values():
        if isinstance(item, TensorItem):
            for piece in item.pieces:
                t = piece.tensor
                sizes.append(t.numel() * t.element_size())
    return sizes


def reserve_staging_memory(state_dict: Any = None, *, nbytes: int | None = None) -> StagingReservation:
    """Prepare, on a background thread, the host memory an async save of ``state_dict`` (or of
    ``nbytes`` bytes) will stage into, so that the first :func:`distckpt.async_save` does not pay
    for allocating it: allocated, every page faulted in, and pinned at its exact size when CUDA is
    available. Returns at once; the reservation's ``wait()`` waits for the memory.

    Call it once the model and optimizer exist (after the first optimizer step, when the
    optimizer's states exist: a state that grows later is staged through a plain allocation once
    and the difference reserved in the background). When the pool already holds that much (idle
    or being prepared, or held by a save in flight) nothing more is reserved; otherwise its idle
    memory is replaced by segments packed for these pieces (at most 64 MiB each unless one piece
    is larger, each pinned by its own call), as much as DISTCKPT_STAGING_POOL_BYTES allows (whole
    segments);
    :func:`release_staging_memory` frees it. An async save that starts before the reservation is
    ready stages into the segments already made and the rest through its overflow segment, and
    supersedes the reservation (``superseded``: nothing more of it is added), rather than keeping
    both or waiting for it on the caller's path. Not collective: each rank reserves for its own
    tensors (the local shards; an upper bound where replicated tensors are written by one rank).

    Raises:
        ValueError: neither or both of ``state_dict`` and ``nbytes`` given, or ``nbytes`` < 0.
        Errors of flattening ``state_dict`` (as :func:`distckpt.save` raises them).
    """
    if (state_dict is None) == (nbytes is None):
        raise ValueError("reserve_staging_memory() takes a state_dict or nbytes=, not both or neither")
    if nbytes is not None:
        if int(nbytes) < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        n = int(nbytes)
        sizes = [_CHUNK] * (n // _CHUNK) + ([n % _CHUNK] if n % _CHUNK else [])
    else:
        sizes = _local_tensor_bytes(state_dict)
    pool = _POOL
    # Memory already idle, being prepared, or held by a save in flight (the pool gets it back
    # when the save ends) counts toward the request: reserving beside a save in flight of the
    # same state would leave two copies in the pool after it.
    have = pool.held_bytes()
    if have >= sum(_pack(sizes)):
        done = StagingReservation(0)
        done._done.set()
        return done
    if have:
        pool.clear()  # then reserve the whole fit: segments packed for these pieces
    return pool.reserve(sizes)


# Stagings running off the caller's thread (async saves with stage_in_background=True): the event
# each sets once its copies are over. A load waits for them first (wait_for_staging): a load
# fills the caller's tensors in place, and a copy still reading them would stage a mix.
_STAGING: "set[threading.Event]" = set()
_STAGING_LOCK = threading.Lock()


_STEP_HOOK = None      # the optimizer step pre-hook below, registered at the first such staging
_STEP_WARNED = False


def staging_started(done: threading.Event) -> None:
    """Register a staging in flight off the caller's thread; ``done`` is set when it ends (the
    caller sets it, then calls :func:`staging_ended`). From the first one on, every torch.optim
    optimizer's ``step()`` in this process waits for the stagings in flight first
    (:func:`_wait_before_step`)."""
    global _STEP_HOOK
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _STEP_HOOK = register_optimizer_step_pre_hook(_wait_before_step)
    with _STAGING_LOCK:
        _STAGING.add(done)


def staging_ended(done: threading.Event) -> None:
    """Unregister a staging :func:`staging_started` registered (``done`` is set by then; a
    staging never registered is no error)."""
    with _STAGING_LOCK:
        _STAGING.discard(done)


def wait_for_staging() -> None:
    """Wait until no staging of this process runs off the caller's thread (the copies of async
    saves started with ``stage_in_background=True``). Their writes may go on."""
    with _STAGING_LOCK:
        pending = list(_STAGING)
    for done in pending:
        done.wait()


def _wait_before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A global optimizer step pre-hook: wait for the stagings in flight before a step changes
    the state they copy.

    Why a hook as well as the version counters the staging compares: an optimizer step changes
    parameters in ways no counter sees -- through a DTensor (FSDP2, TP: the local tensors' counters
    stay put, and foreach steps do not move the wrapper's either) and through torch's fused
    kernels (``fused=True``: none moves) -- so a step taken before ``wait_staged()`` would save a
    mix of two steps, silently. Every torch.optim optimizer runs global pre-hooks (and so does a
    wrapper that steps through one before changing anything: DeepSpeed's ZeRO optimizers,
    GradScaler); waiting turns the broken contract into a delay, said once."""
    global _STEP_WARNED
    if not _STAGING:  # (no lock: a set's truth is one read; a staging starting now began after this step)
        return None
    t0 = time.perf_counter()
    wait_for_staging()
    waited = time.perf_counter() - t0
    if not _STEP_WARNED and waited > 0.001:
        _STEP_WARNED = True
        log.warning("distckpt: %s.step() waited %.3f s for an async save's staging (stage_in_background) to end "
                    "before changing the state; call handle.wait_staged() (torchtitan: maybe_wait_for_staging()) "
                    "before the optimizer step", type(optimizer).__name__, waited)
    return None


def _forget_stagings_after_fork() -> None:
    """A forked child has no staging threads: nothing of the parent's is in flight in it."""
    global _STAGING_LOCK
    _STAGING.clear()
    _STAGING_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_stagings_after_fork)


def stage(mine: list, pool: StagingPool, *, after: dict | None = None) -> tuple[Arena | None, int]:
    """Copy each of ``mine``'s pieces ((fqn, Piece) pairs) into ``pool``'s segments and point the
    piece at its copy; device tensors are copied with non-blocking DMAs, then one synchronize per
    device. Returns the arena (None when there is nothing to stage) and the bytes staged.

    ``after``: {CUDA device: event recorded on the caller's stream when the save was called}, for
    a copy off the caller's thread (an async save staging in the background): that device's
    copies then run on a side stream that waits for the event, and only that stream is waited
    for. Why: the values saved are those of the call (work the caller queued before it is done),
    and the copies neither wait for nor delay the work the caller queues after it (the next
    forward and backward); a synchronize of the whole device would wait for that work too.

    Raises whatever an allocation or a copy raises (e.g. out of memory); the arena then goes back
    to the pool."""
    specs = []
    for _fqn, piece in mine:
        t = piece.tensor
        specs.append(t.numel() * t.element_size())
    if sum(specs) == 0:
        return None, 0
    pin = torch.cuda.is_available()
    arena, places = pool.take(specs)
    devices = set()
    cpu_dst, cpu_src = [], []
    side: dict = {}  # CUDA device -> the side stream its copies run on (``after`` given)
    try:
        for (_fqn, piece), (seg, off), nbytes in zip(mine, places, specs):
            src = piece.tensor.detach()
            dst = seg.buf[off:off + nbytes].view(src.dtype).view(tuple(src.shape))
            if src.numel() == 0:
                pass  # nothing to copy, wherever it lives (an empty meta tensor has no data to copy)
            elif src.device.type == "cpu":
                if src.is_conj() or src.is_neg():
                    dst.copy_(src)  # resolved by copy_; kept out of the foreach batch, as before
                else:
                    cpu_dst.append(dst)
                    cpu_src.append(src)
            else:
                stream = None
                if after is not None and src.device.type == "cuda" and src.device in after:
                    stream = side.get(src.device)
                    if stream is None:
                        stream = side[src.device] = torch.cuda.Stream(device=src.device)
                        stream.wait_event(after[src.device])
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    if src.is_conj() or src.is_neg():
                        # Blocking: a non_blocking device-to-host copy of a conj/neg view applies
                        # the conjugation on the host before the DMA has landed (the DMA then
                        # overwrites it).
                        dst.copy_(src)
                    else:
                        # One DMA per tensor into pinned memory (a synchronous copy into a
                        # pageable overflow segment), all queued before a single wait.
                        dst.copy_(src, non_blocking=True)
                if stream is None:
                    devices.add(src.device)
            piece.tensor = dst
        if cpu_dst:
            # One call for all CPU tensors: no Python loop per copy (thousands of small tensors).
            torch._foreach_copy_(cpu_dst, cpu_src)
        for stream in side.values():
            stream.synchronize()
        for dev in devices:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            elif hasattr(torch, dev.type) and hasattr(getattr(torch, dev.type), "synchronize"):
                getattr(torch, dev.type).synchronize()
    except BaseException:
        # DMAs already queued on a side stream may still be landing in the arena's segments:
        # they end before the segments go back to the pool (or are freed).
        for wait in [stream.synchronize for stream in side.values()] + [
                functools.partial(torch.cuda.synchronize, dev) for dev in devices if dev.type == "cuda"]:
            try:
                wait()
            except Exception:  # noqa: BLE001 - the copy's own error is the one raised
                pass
        pool.release(arena, pin=pin)
        raise
    return arena, sum(specs)
