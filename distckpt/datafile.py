"""A data file's layout, written once for every back end: where each chunk goes, its block
checksums, and the format-3 index that ends the file (docs/FORMAT.md, "Data file index").

:func:`write_data_file` lays out one rank's pieces in a :class:`Sink`, the few byte-level calls a
back end implements: the POSIX back end's sink is its O_DIRECT io_uring
:class:`~distckpt.storage.posix.writer.Writer` itself (its ``write_checksummed`` checksums the
bytes in C while they are written: no extra pass, no extra copy), the object store's the part
buffer of its multipart upload. :func:`size_bound` is what a back end reserves or sizes before the
first byte (a fallocate, an upload's part size).

The placement rule, the same for both back ends:
  * chunks are written in :func:`write_order`: the pieces' order, except that for a sink whose
    large chunks' writes stay in flight after their call returns (the O_DIRECT writer's held
    zero-copy writes) the smaller pieces are spread over the gaps after the large ones, so that
    their per-piece work (a copy into staging, a checksum, Python) runs while the disk is still
    writing a large chunk instead of after the last one; each chunk starts at the next multiple of the sink's
    ``alignment`` (:data:`distckpt.plan.ALIGNMENT`, 4096, or the larger O_DIRECT offset alignment
    of a file system that needs one), so an O_DIRECT writer writes and a reader reads whole pages;
  * except that a sink which writes a chunk straight from the tensor's memory may start it up to
    its O_DIRECT offset alignment minus one byte later (``pad_for``): torch's large CPU tensors
    start 64 bytes past a page, and moving the chunk saves a copy of every byte. Only the POSIX
    writer does; an object store copies every byte into its part buffer anyway, so it never moves
    a chunk;
  * the index starts at the next multiple of ``alignment`` after the last chunk and ends the file.
Before this module the object store placed chunks with ``plan.assign_offsets`` and the POSIX
writer with ``pad_to`` / ``pad_for``: the same offsets whenever ``pad_for`` does not move a chunk,
so both back ends write the bytes they wrote before. Readers take every offset from the records
and assume no alignment.

Checksums: ``crcs[k]`` is the crc32c of the chunk's ``k``-th ``checksum_block`` bytes
(:func:`distckpt.manifest.block_crcs`), computed by the sink in the same pass that writes them.
Pieces on a CUDA device reach the sink through the pinned ring of
:class:`distckpt.staging.ring.DeviceStager` (parts cut at checksum-block multiples, copied while
earlier parts are written); every other piece is viewed in place
(:func:`distckpt.tensorbytes.host_bytes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Protocol, Sequence

from . import manifest as mf
from .checksum import crc32c
from .config import get_config
from .plan import ALIGNMENT, assign_offsets
from .staging.ring import DeviceStager, needs_staging
from .tensorbytes import host_bytes

__all__ = ["Sink", "DataFile", "write_data_file", "write_order", "size_bound"]


class Sink(Protocol):
    """One data file's bytes, appended front to back; what a back end implements.

    Every method raises the back end's typed :class:`distckpt.errors.StorageError` subclasses on a
    failed write; the back end, not :func:`write_data_file`, finishes (durable) or aborts the file.
    """

    #: Chunks and the index start on multiples of this: :data:`distckpt.plan.ALIGNMENT` or a
    #: multiple of it.
    alignment: int

    #: Chunks of at least this many bytes, given ``hold``, may still be being written when
    #: :meth:`write_checksummed` returns (0: none are); :func:`write_order` fills those gaps.
    hold_min: int

    def tell(self) -> int:
        """Bytes appended so far (where the next byte lands)."""

    def pad_to(self, alignment: int) -> int:
        """Append zero bytes up to the next multiple of ``alignment``; return the position."""

    def pad_for(self, data: Any, alignment: int) -> int:
        """:meth:`pad_to` ``alignment``, plus, for a sink that writes ``data`` straight from its
        memory, fewer zero bytes than its offset alignment so that it can; return where ``data``
        will start."""

    def write(self, data: Any) -> int:
        """Append ``data`` (a C-contiguous buffer, not referenced after return); return the new position
        (where the next byte lands: after the index, the file's size)."""

    def write_checksummed(self, data: Any, block: int, hold: Any = None) -> tuple[int, ...]:
        """:meth:`write` ``data`` and return the crc32c of each ``block`` bytes of it, the last
        one partial (:func:`distckpt.manifest.block_crcs`). ``hold`` (an object keeping ``data``'s
        memory alive) promises the bytes stay unchanged until the sink is finished: a sink may then
        keep referencing them after return (the O_DIRECT writer leaves a large chunk's writes in
        flight while the next chunk is written); without it, ``data`` is not referenced after
        return."""


@dataclasses.dataclass(frozen=True)
class DataFile:
    """What :func:`write_data_file` wrote.

    Attributes:
        index: ``(offset, length, crc32c)`` of the file's index, the MANIFEST's ``files[i].index``.
        size: The file's length in bytes (the index ends it).
    """

    index: tuple[int, int, int]
    size: int


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def write_order(sizes: Sequence[int], hold_min: int) -> list[int]:
    """The order (indexes into ``sizes``, the pieces' byte counts) in which :func:`write_data_file`
    writes them into a sink whose :attr:`Sink.hold_min` is ``hold_min``.

    With ``hold_min`` 0, or no piece of at least ``hold_min`` bytes, the pieces' own order.
    Otherwise the large pieces keep their order, and after the k-th of L of them come the smaller
    pieces, in their order, until k/L of the smaller pieces' bytes are placed. Why: a large
    piece's call returns with up to a queue of its writes in flight (tens of MiB, tens of ms of
    disk time), and the smaller pieces' work (a Python call each, a copy into staging, a checksum)
    then runs while the disk is busy. Written last, as in the pieces' order, the calls of 2,000
    pieces of 16 KiB after 7 large ones took 34-37 ms, much of it waiting for the drained queue;
    spread, 12-19 ms, and the save 7-15 ms less (docs/BENCHMARKS.md, "Small pieces in the gaps").
    Readers take every chunk's place from the index and sort a tensor's chunks
    by their offsets, so the order is free; it is a function of the sizes alone (a save writes the
    same file for the same state)."""
    n = len(sizes)
    large = [i for i in range(n) if hold_min and sizes[i] >= hold_min]
    if not large:
        return list(range(n))
    small = [i for i in range(n) if sizes[i] < hold_min]
    total = sum(sizes[i] for i in small)
    order: list[int] = []
    placed, j = 0, 0
    for k, i in enumerate(large, 1):
        order.append(i)
        share = total * k // len(large)
        while j < len(small) and (placed < share or k == len(large)):
            placed += sizes[small[j]]
            order.append(small[j])
            j += 1
    return order


def size_bound(pieces: Sequence[tuple[str, Any]], checksum_block: int, alignment: int, *,
               moves_chunks: bool) -> int:
    """An upper bound on the size of the data file :func:`write_data_file` writes for ``pieces``
    into a sink of ``alignment`` (``moves_chunks``: whose ``pad_for`` may start a chunk later than
    its aligned offset), computed without encoding the index: a fallocate or a part size needs
    room, not the exact size. Raises ValueError for an alignment that is not a power of two."""
    _, end = assign_offsets([_nbytes(p.tensor) for _, p in pieces], alignment=alignment)
    # A chunk moved by less than the alignment pushes the next aligned start by at most one alignment.
    moved = alignment * len(pieces) if moves_chunks else 0
    # The index: magic, the array's header (<= 5 B), and per record at most 40 B of msgpack headers
    # and ints (offset, nbytes, 9 B each; offsets and sizes, 9 B per int), the fqn, the crcs.
    index = len(mf.INDEX_MAGIC) + 5 + sum(
        40 + len(fqn.encode()) + 18 * len(p.sizes) + 4 * -(-_nbytes(p.tensor) // checksum_block) for fqn, p in pieces)
    return end + moved + alignment + index


def write_data_file(sink: Sink, rank: int, pieces: Sequence[tuple[str, Any]], checksum_block: int) -> DataFile:
    """Write rank ``rank``'s ``pieces`` (``(fqn, piece)`` with the piece's ``tensor``, ``offsets``
    and ``sizes``) into ``sink`` by the placement rule of this module, then the index of their chunk
    records. Returns the index's reference and the file's size; the sink holds every byte, not yet
    finished (made durable, completed) by its back end.

    Raises:
        ValueError: ``sink.alignment`` is not a positive multiple of :data:`distckpt.plan.ALIGNMENT`.
        The sink's typed errors (DiskFullError, StorageIOError, ...), and what staging a device
        piece raises; the caller aborts the sink.
    """
    alignment = sink.alignment
    if alignment <= 0 or alignment % ALIGNMENT:
        raise ValueError(f"a data file's alignment must be a positive multiple of {ALIGNMENT}, not {alignment}")
    tensors = [p.tensor for _, p in pieces]
    # Pieces on a GPU stream through pinned slots, copied while earlier pieces are being written.
    stager = (DeviceStager(tensors, block=checksum_block, staging_bytes=get_config().device_staging)
              if any(needs_staging(t) for t in tensors) else contextlib.nullcontext())
    records: list[tuple[str, mf.ChunkRecord]] = []
    # A device piece's parts come from the stager in the pieces' order: then the order is kept.
    order = (range(len(pieces)) if isinstance(stager, DeviceStager)
             else write_order([_nbytes(t) for t in tensors], sink.hold_min))
    with stager:
        for i in order:
            fqn, piece = pieces[i]
            if needs_staging(piece.tensor):
                offset = sink.pad_to(alignment)
                crcs: list[int] = []
                nbytes = 0
                for view in stager.parts(i):  # parts cut at checksum-block multiples
                    crcs.extend(sink.write_checksummed(view, checksum_block))
                    nbytes += len(view)
                chunk_crcs = tuple(crcs)
            else:
                view, keep = host_bytes(piece.tensor)
                offset = sink.pad_for(view, alignment)
                # One write per chunk, its block checksums computed in the same pass. The pieces
                # are not changed until the file is finished (the caller's state during a save, or
                # a staged copy), so the sink may keep writing from them after it returns.
                chunk_crcs, nbytes = sink.write_checksummed(view, checksum_block, hold=keep), len(view)
                del keep  # the sink holds its own reference while it still needs the bytes
            records.append((fqn, mf.ChunkRecord(offsets=tuple(piece.offsets), sizes=tuple(piece.sizes), file=rank,
                                                offset=offset, nbytes=nbytes, crcs=chunk_crcs)))
    # The index goes last, once every crc is known.
    index = mf.encode_index(records)
    index_offset = sink.pad_to(alignment)
    size = sink.write(index)
    return DataFile(index=(index_offset, len(index), crc32c(index)), size=size)
