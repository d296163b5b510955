"""Host staging memory of async saves: one arena of aligned (pinned when CUDA is available) host
memory per save in flight, kept for the next save when it fits.

Invariants:
  * Bounded: one arena per save in flight (at most one: saves are serialized), kept for the next
    save when it fits (the same model gets the same layout, so the same memory), replaced when it
    does not; DISTCKPT_STAGING_POOL_BYTES caps the idle arena kept between saves (0: keep none), and
    :func:`release_staging_memory` frees it now.
  * Large pieces start at 4 KiB boundaries, so the O_DIRECT writer can write them without another
    copy.
  * After :func:`stage` returns, every staged piece points at its copy: changing the caller's
    tensors no longer changes what is written.
"""

from __future__ import annotations

import threading

import torch

from ..config import get_config

__all__ = ["StagingPool", "staging_pool", "release_staging_memory", "stage"]

# Pieces of at least this many bytes start on a page boundary (O_DIRECT can write them in place);
# smaller ones only on a cache line (the writer copies small writes into its staging anyway).
_PAGE = 4096
_BIG = 64 << 10
_SMALL_ALIGN = 64


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class _Arena:
    """One aligned host buffer; pieces are carved out of it at aligned offsets."""

    def __init__(self, capacity: int, pin: bool) -> None:
        self.capacity = capacity
        self.pinned = pin
        self._raw = torch.empty(capacity + _PAGE, dtype=torch.uint8, pin_memory=pin)
        start = -self._raw.data_ptr() % _PAGE
        self.buf = self._raw[start:start + capacity]

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        flat = self.buf[offset:offset + nbytes]
        return flat.view(dtype).view(shape)


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, cursor = [], 0
    for n in sizes:
        cursor = _round_up(cursor, _PAGE if n >= _BIG else _SMALL_ALIGN)
        offsets.append(cursor)
        cursor += n
    return offsets, _round_up(cursor, _PAGE)


class StagingPool:
    """Aligned host staging memory reused across async saves of one process.

    Holds at most one idle arena. ``acquire(n)`` reuses it when it holds ``n`` bytes and is not more
    than twice as large (so a shrinking state does not pin a stale peak forever); otherwise the idle
    one is dropped first and a new one allocated, so memory never holds two arenas because of the
    pool. Pinned (page-locked) when CUDA is available: device-to-host copies are then DMAs.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: _Arena | None = None
        self.allocations = 0  # arenas allocated so far (tests / benchmarks: reuse is visible)

    def acquire(self, nbytes: int, pin: bool) -> _Arena:
        with self._lock:
            arena, self._idle = self._idle, None
        if arena is not None and arena.pinned == pin and nbytes <= arena.capacity <= 2 * nbytes + (1 << 20):
            return arena
        del arena  # free the old one before allocating the new one
        self.allocations += 1
        return _Arena(nbytes, pin)

    def release(self, arena: _Arena | None) -> None:
        """Take ``arena`` back after its save. It is kept for the next save only if no larger one
        is idle and it is within DISTCKPT_STAGING_POOL_BYTES (when set); otherwise it is freed."""
        if arena is None:
            return
        bound = get_config().staging_pool_bytes
        if bound is not None and arena.capacity > bound:
            return  # freed when the caller drops its reference
        with self._lock:
            if self._idle is None or self._idle.capacity < arena.capacity:
                self._idle = arena

    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle.capacity if self._idle is not None else 0

    def clear(self) -> int:
        """Free the idle arena (an arena in use is freed when its save finishes). Returns its bytes."""
        with self._lock:
            arena, self._idle = self._idle, None
        return arena.capacity if arena is not None else 0


_POOL = StagingPool()


def staging_pool() -> StagingPool:
    """The process-wide staging pool of async saves."""
    return _POOL


def release_staging_memory() -> int:
    """Give back the host memory async saves keep for reuse (the idle staging arena of this
    process), now. An async save still in flight keeps its arena until it finishes (then it is
    kept again, within DISTCKPT_STAGING_POOL_BYTES, unless released once more). Returns the bytes
    freed. The next async save allocates a new arena (one copy of its state's size)."""
    return _POOL.clear()


def stage(mine: list, pool: StagingPool) -> tuple[_Arena | None, int]:
    """Copy each of ``mine``'s pieces ((fqn, Piece) pairs) into one arena of ``pool`` and point the
    piece at its copy; device tensors are copied with non-blocking DMAs, then one synchronize per
    device. Returns the arena (None when there is nothing to stage) and the bytes staged.

    Raises whatever the allocation or a copy raises (e.g. out of memory); the arena then goes back
    to the pool."""
    specs = []
    for _fqn, piece in mine:
        t = piece.tensor
        specs.append(t.numel() * t.element_size())
    offsets, capacity = _layout(specs)
    if capacity == 0:
        return None, 0
    pin = torch.cuda.is_available()
    arena = pool.acquire(capacity, pin)
    devices = set()
    cpu_dst, cpu_src = [], []
    try:
        for (_fqn, piece), off, nbytes in zip(mine, offsets, specs):
            src = piece.tensor.detach()
            dst = arena.view(off, nbytes, src.dtype, tuple(src.shape))
            if src.device.type == "cpu":
                if src.is_conj() or src.is_neg():
                    dst.copy_(src)
                else:
                    cpu_dst.append(dst)
                    cpu_src.append(src)
            else:
                # One DMA per tensor into pinned memory, all queued before a single wait.
                dst.copy_(src, non_blocking=True)
                devices.add(src.device)
            piece.tensor = dst
        if cpu_dst:
            # One call for all CPU tensors: no Python loop per copy (thousands of small tensors).
            torch._foreach_copy_(cpu_dst, cpu_src)
        for dev in devices:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            elif hasattr(torch, dev.type) and hasattr(getattr(torch, dev.type), "synchronize"):
                getattr(torch, dev.type).synchronize()
    except BaseException:
        pool.release(arena)
        raise
    return arena, sum(specs)
