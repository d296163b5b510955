"""Device-to-host staging for a synchronous save: DMA copies overlapped with the disk writes.

A sync save writes its pieces in order. A piece on the host is viewed in place
(:func:`distckpt.tensorbytes.host_bytes`); a piece on an accelerator must first reach host memory. Done
naively (one blocking copy, then the write) the GPU link and the disk take turns. Here device
pieces reach the writer through a small ring of pinned host slots instead: while the writer writes
slot ``k``, the copies into slots ``k+1 .. k+n-1`` run as DMAs on a side stream, so a save of GPU
state runs at the disk's speed plus one slot's copy.

Invariants:
  * Bytes and checksums are exactly those of saving the same tensors from host memory: a piece is
    cut into parts at multiples of the checksum block, so the concatenated per-part checksums equal
    the piece's (:func:`distckpt.manifest.block_crcs`).
  * Ordering: the side stream first waits for each device's current stream, so every kernel the
    caller queued before ``save()`` has written its tensors before they are copied.
  * Memory: ``DISTCKPT_DEVICE_STAGING`` bytes of pinned host memory (default 64 MiB: 2 slots of
    32 MiB, eight 4 MiB O_DIRECT requests each), page-locked for the save and given back when it ends
    (nothing held between saves); a piece larger than a slot streams through the ring in parts.
  * A part's memoryview is valid until the next part is asked for; the writer copies or writes it
    before ``write()`` returns (:mod:`distckpt.storage.posix.writer`), so the slot is free then.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Any, Iterator

import torch

__all__ = ["DeviceStager", "needs_staging"]

log = logging.getLogger("distckpt")

# Two slots: one being written while the next is filled. A slot is one writer call; the writer keeps
# up to DISTCKPT_QUEUE_DEPTH requests of it in flight (4 MiB slots, one request each, left an H100
# machine's disk at queue depth 1: 0.73x fio against 0.86x for whole-piece copies).
SLOTS = 2
_ALIGN = 4096  # parts start on a page: the O_DIRECT writer writes them without another copy


def needs_staging(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` goes through the ring: its bytes live on a CUDA device. (Other
    accelerators take :func:`distckpt.tensorbytes.host_bytes`' one blocking copy per piece.)"""
    return tensor.device.type == "cuda"


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements in row-major order as a flat uint8 tensor on its device."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class _Pinned:
    """``nbytes`` of page-aligned host memory, page-locked with cudaHostRegister when that works.

    Registered memory is released exactly at :meth:`close` (torch's pinned caching allocator would
    keep it for the process's life). If registration is refused (e.g. RLIMIT_MEMLOCK), the copies
    still run, as synchronous pageable copies; a warning says so."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._mm = mmap.mmap(-1, nbytes)
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._ptr = self.buf.data_ptr()
        self.pinned = False
        err = torch.cuda.cudart().cudaHostRegister(self._ptr, nbytes, 0)
        if int(err) == 0:
            self.pinned = True
        else:
            log.warning("distckpt: cudaHostRegister of %d bytes failed (error %s): device-to-host copies "
                        "of this save are not overlapped with its writes (raise RLIMIT_MEMLOCK to fix)",
                        nbytes, int(err))

    def view(self, start: int, n: int) -> memoryview:
        return memoryview((ctypes.c_char * n).from_address(self._ptr + start)).cast("B")

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self.pinned = False
        del self.buf
        try:
            self._mm.close()
        except BufferError:  # a view still exported: unmapped when it is collected
            pass


class DeviceStager:
    """Streams the device pieces of one rank's write order through a ring of pinned slots.

    ``tensors`` is the whole write order (host tensors included; they are skipped). ``block`` is the
    checksum block: parts of a piece are multiples of it, except the piece's last. Use as a context
    manager; :meth:`parts` must be called for the device pieces in increasing index order.
    """

    def __init__(self, tensors: list[torch.Tensor], *, block: int, staging_bytes: int) -> None:
        slot = max(staging_bytes // SLOTS, block)
        slot = -(-slot // block) * block
        slot = -(-slot // _ALIGN) * _ALIGN
        self.slot_bytes = slot
        # parts: (piece index, start, length) in write order
        self._parts: list[tuple[int, int, int]] = []
        self._first: dict[int, int] = {}  # piece index -> index of its first part
        self._tensors = tensors
        self._flat: dict[int, torch.Tensor] = {}
        for i, t in enumerate(tensors):
            if not needs_staging(t):
                continue
            n = t.numel() * t.element_size()
            self._first[i] = len(self._parts)
            self._parts.extend((i, s, min(slot, n - s)) for s in range(0, n, slot))
            if n == 0:
                self._parts.append((i, 0, 0))
        self._mem = _Pinned(slot * SLOTS) if self._parts else None
        self._streams: dict[torch.device, Any] = {}
        # slot -> (events, [(part index, byte offset in the slot)]); parts are packed into slots
        self._slots: list[tuple[list[Any], list[tuple[int, int]]] | None] = [None] * SLOTS
        self._place: dict[int, tuple[int, int]] = {}  # part index -> (slot, offset)
        self._next_part = 0     # first part not yet scheduled
        self._next_slot = 0     # slot the next schedule goes to (ring order)
        self._held = -1         # slot whose views the consumer may still hold
        if self._parts:
            self._schedule()

    # -- producer -----------------------------------------------------------------------------
    def _stream(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
            # Kernels the caller queued on its current stream (up to now) write these tensors.
            s.wait_stream(torch.cuda.current_stream(device))
        return s

    def _fill_slot(self, k: int) -> None:
        base = k * self.slot_bytes
        used, placed, events = 0, [], []
        devices = set()
        while self._next_part < len(self._parts):
            pi, start, n = self._parts[self._next_part]
            at = -(-used // _ALIGN) * _ALIGN
            if placed and at + n > self.slot_bytes:
                break
            t = self._tensors[pi]
            stream = self._stream(t.device)
            # On the side stream: a non-contiguous piece's contiguous copy is then made after the
            # caller's kernels (the stream waited for them) and before the DMA that reads it.
            with torch.cuda.stream(stream):
                flat = self._flat.get(pi)
                if flat is None:
                    flat = self._flat[pi] = _flat_bytes(t)
                if n:
                    self._mem.buf[base + at:base + at + n].copy_(flat[start:start + n], non_blocking=True)
                    devices.add(t.device)
            placed.append((self._next_part, at))
            self._place[self._next_part] = (k, at)
            used = at + n
            self._next_part += 1
        for d in devices:
            ev = torch.cuda.Event()
            ev.record(self._streams[d])
            events.append(ev)
        self._slots[k] = (events, placed)

    def _schedule(self) -> None:
        """Fill every free slot, in ring order, with the next parts."""
        for _ in range(SLOTS):
            k = self._next_slot
            if self._slots[k] is not None or self._next_part >= len(self._parts):
                return
            self._fill_slot(k)
            self._next_slot = (k + 1) % SLOTS

    def _release_through(self, k: int) -> None:
        if self._held >= 0 and self._held != k:
            done = self._slots[self._held]
            self._slots[self._held] = None
            if done is not None:
                # The pieces whose last part left the ring no longer need their device copy.
                for part, _ in done[1]:
                    pi = self._parts[part][0]
                    if part + 1 >= len(self._parts) or self._parts[part + 1][0] != pi:
                        self._flat.pop(pi, None)
            self._schedule()
        self._held = k

    # -- consumer -----------------------------------------------------------------------------
    def parts(self, index: int) -> Iterator[memoryview]:
        """The host bytes of piece ``index``, as consecutive parts (views into pinned memory)."""
        first = self._first[index]
        p = first
        while p < len(self._parts) and self._parts[p][0] == index:
            if p not in self._place:
                raise RuntimeError(f"device staging out of order: part {p} of piece {index} not scheduled")
            k, at = self._place.pop(p)
            self._release_through(k)
            events, _ = self._slots[k]
            for ev in events:
                ev.synchronize()
            n = self._parts[p][2]
            yield self._mem.view(k * self.slot_bytes + at, n) if n else memoryview(b"")
            p += 1

    def close(self) -> None:
        """Wait for copies still in flight, then give the pinned memory back."""
        for slot in self._slots:
            if slot is not None:
                for ev in slot[0]:
                    ev.synchronize()
        self._slots = [None] * SLOTS
        self._flat.clear()
        if self._mem is not None:
            self._mem.close()
            self._mem = None

    def __enter__(self) -> "DeviceStager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
