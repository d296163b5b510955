"""A committed data file read front to back with every checksum checked as the bytes pass: what
the drain (a local step to the remote tier) and the peer transfers (a node's files to another
node) send or keep, so that a damaged byte is never copied into another tier.

The checksummed ranges of a data file (docs/FORMAT.md) are each chunk's blocks of
``checksum_block`` bytes and, in format 3, the index at its end, whose crc32c the MANIFEST holds.
:func:`stream_verified` reads the file in bounded pieces through the store's readers (O_DIRECT
where the file system allows it), checks each range as it completes (a range may straddle two
pieces) and hands every piece on; the padding between chunks is covered by no checksum and is
copied as it is.
"""

from __future__ import annotations

from typing import Callable, Iterator

from .. import manifest as mf
from ..checksum import crc32c
from ..errors import ChecksumMismatchError, ManifestCorruptError
from ..storage import Store, join

__all__ = ["READ_PIECE", "records", "spans", "Verifier", "stream_verified", "piece_sizes"]

#: Bytes of a data file read at once (the one read buffer of a rank's copy).
READ_PIECE = 8 << 20


def piece_sizes(size: int, piece: int | None = None) -> list[int]:
    """The sizes of the pieces :func:`stream_verified` hands on for a file of ``size`` bytes (a
    receiver that knows the size knows the pieces)."""
    piece = piece or READ_PIECE
    return [min(piece, size - pos) for pos in range(0, size, piece)]


def stream_verified(store: Store, path: str, header: mf.Manifest, i: int,
                    consume: Callable[[int, memoryview], None], *, piece: int | None = None) -> int:
    """Read data file ``i`` of the checkpoint at ``path`` front to back in pieces of ``piece``
    bytes (default :data:`READ_PIECE`; :func:`piece_sizes`), check every checksummed range, and call ``consume(pos, view)``
    with each piece after its completed ranges were checked (``view`` is reused for the next
    piece: copy what must outlive the call). Returns the file's size.

    Raises:
        ChecksumMismatchError: a block or the index differs from its crc32c (the pieces before it
            were handed on: the caller discards what it made of them).
        ManifestCorruptError: the index does not decode or places chunks outside the file.
        DataFileMissingError, DataFileTruncatedError, CheckpointCorruptError and the store's typed
            errors: the file is gone, has another size, or cannot be read.
    """
    piece = piece or READ_PIECE
    entry = header.files[i]
    check = Verifier(spans(header, i, records(store, path, header, i), path), path, entry)
    # The reader's request size is a power of two (the C reader's rule) no smaller than ours.
    locations, open_reader, _, _ = store.data_readers(path, header, [i], piece=1 << (piece - 1).bit_length())
    buf = bytearray(max(1, min(piece, entry.size)))
    view = memoryview(buf)
    with open_reader(locations[i]) as reader:
        pos = 0
        while pos < entry.size:
            n = min(len(buf), entry.size - pos)
            chunk = view[:n]
            reader.read_into([(pos, n, chunk)])
            check.update(pos, chunk)
            consume(pos, chunk)
            pos += n
        check.finish()
    return entry.size


def records(store: Store, path: str, header: mf.Manifest, i: int) -> list[tuple[str, mf.ChunkRecord]]:
    """(fqn, chunk record) of every chunk in data file ``i``: from its index (format 3, read
    through the store and checked against the MANIFEST's crc32c), or from the MANIFEST (1, 2)."""
    if header.files[i].index is None:
        return [(fqn, c) for fqn, t in header.tensors.items() for c in (t.chunks or ()) if c.file == i]
    return mf.parse_index(header, i, store.read_index(path, header, i), path=join(path, mf.MANIFEST_NAME))


def spans(header: mf.Manifest, i: int, records: list[tuple[str, mf.ChunkRecord]],
           path: str) -> Iterator[tuple[int, int, int, str]]:
    """(start, end, crc32c, what) of every checksummed range of data file ``i`` in file order: each
    chunk's blocks of ``checksum_block`` bytes (the last one partial), then the index. The bytes
    between them are alignment padding, which nothing reads. Lazily: a file's blocks can be many.

    Raises (while iterated) ManifestCorruptError for chunks that overlap, leave the data region,
    or carry another number of block crcs than their size needs."""
    entry, block = header.files[i], header.checksum_block
    end_of_data = entry.index[0] if entry.index is not None else entry.size
    where = join(path, entry.name)
    prev = 0
    for fqn, c in sorted(records, key=lambda r: r[1].offset if type(r[1].offset) is int else -1):
        if type(c.offset) is not int or type(c.nbytes) is not int or c.nbytes < 0:
            raise ManifestCorruptError(f"index of {entry.name}: chunk of {fqn!r} has offset {c.offset!r} and size "
                                       f"{c.nbytes!r}", path=where)
        if c.offset < prev or c.offset + c.nbytes > end_of_data or len(c.crcs) != -(-c.nbytes // block):
            raise ManifestCorruptError(
                f"index of {entry.name}: chunk of {fqn!r} at [{c.offset}, {c.offset + c.nbytes}) with {len(c.crcs)} "
                f"block crcs overlaps another, leaves the data region [0, {end_of_data}) or needs "
                f"{-(-c.nbytes // block)} crcs", path=where)
        for k, crc in enumerate(c.crcs):
            start = c.offset + k * block
            yield start, min(start + block, c.offset + c.nbytes), crc, f"chunk of {fqn!r} at offset {c.offset}"
        prev = c.offset + c.nbytes
    if entry.index is not None:
        off, length, crc = entry.index
        yield off, off + length, crc, "the index"


class Verifier:
    """Checks a data file's bytes, fed front to back in pieces of any size, against its
    checksummed ranges (:func:`spans`); a range may straddle pieces (its crc32c is continued)."""

    def __init__(self, spans: Iterator[tuple[int, int, int, str]], path: str, entry: mf.FileEntry) -> None:
        self._spans, self._where, self._entry = spans, join(path, entry.name), entry
        self._cur = next(self._spans, None)
        self._crc = 0

    def update(self, pos: int, data: memoryview) -> None:
        """Check ``data``, the bytes at ``pos`` (the end of the previous piece).

        Raises ChecksumMismatchError for a range that ends in it and differs from its crc32c."""
        end = pos + len(data)
        while self._cur is not None and self._cur[0] < end:
            start, stop, want, what = self._cur
            lo, hi = max(start, pos), min(stop, end)
            self._crc = crc32c(data[lo - pos:hi - pos], self._crc)
            if stop > end:
                return  # continued in the next piece
            if self._crc != want:
                raise ChecksumMismatchError(
                    f"data file {self._entry.name}: {what}, bytes [{start}, {stop}): crc32c 0x{self._crc:08x}, "
                    f"expected 0x{want:08x}; nothing was copied from it", path=self._where,
                    file=self._entry.name, key=None, offset=start, expected=want, found=self._crc,
                    remedy="This copy of the file is damaged (disk or memory error): restore the step from "
                           "another copy (another tier or a peer), or save it again.")
            self._crc = 0
            self._cur = next(self._spans, None)

    def finish(self) -> None:
        """Every range was checked (the file ended after the last one). Raises
        ManifestCorruptError otherwise (a range beyond the end: an index that lies)."""
        if self._cur is not None:
            raise ManifestCorruptError(f"index of {self._entry.name}: a checksummed range [{self._cur[0]}, "
                                       f"{self._cur[1]}) lies beyond the end of the file ({self._entry.size} bytes)",
                                       path=self._where)
