"""Streaming writers: one data file, appended front to back, made durable on close.

Invariants:
  * A writer creates its file (O_CREAT|O_EXCL: it never overwrites) and owns exactly one fd (plus,
    for io_uring, the ring's fd). After ``close()`` returns or any method raises, the writer holds
    no fd: every OSError is translated by :func:`errors.from_os_error` only after everything was
    closed, so a typed error never leaks a descriptor (docs/DESIGN.md I5).
  * ``close()`` returns only after the file has exactly ``tell()`` bytes (the O_DIRECT tail is
    written padded to the alignment, then ftruncate()d) and, when ``durable``, after fsync.
  * On failure the partly written file is left in place: the caller owns the temporary directory
    and removes it (distckpt.commit aborts the whole save).
  * ``write`` never references the caller's buffer after it returns: bytes are copied into
    aligned staging (tensor memory need not be aligned), or, for an O_DIRECT backend when the
    buffer is aligned to the file system's DIO memory alignment, written straight from it with
    every such write complete before ``write`` returns. Callers may reuse or free it at once.
    ``write_checksummed(..., hold=obj)`` is the one exception the caller opts into: it promises
    the bytes stay unchanged until ``close()``, and the C writer references ``obj`` while that
    source's zero-copy writes are in flight, so the disk's queue stays full from one large chunk
    to the next (one held source at a time; the checksums are computed during the call).
"""

from __future__ import annotations

import os

from ... import _uring
from ...config import get_config
from ...errors import from_os_error
from .probe import BackendChoice, choose_backend, ensure_sigxfsz_ignored

__all__ = ["Writer", "open_writer"]


class Writer:
    """An append-only file writer for one backend. Use :func:`open_writer` to make one.

    Attributes:
        path: The file being written.
        backend: "uring", "pwrite" or "buffered".
        alignment: The offset alignment callers should align chunk starts to (see ``pad_to``).
        durable: Whether ``close()`` fsyncs.
    """

    def __init__(self, path: str, choice: BackendChoice, durable: bool, size_hint: int | None = None) -> None:
        self.path = path
        self.backend = choice.name
        self.alignment = choice.alignment
        self.durable = durable
        # Zero-copy writes go out in requests of twice DISTCKPT_BLOCK_SIZE (the staged ones in
        # DISTCKPT_STAGE_BLOCK). From a tensor's own memory (its first page partial, its pages in
        # no particular physical order) 4 MiB requests ran at 1.2 to 2.2 GB/s, depending on the
        # process, on a virtio disk where fio wrote 2.9 GB/s, and 8 MiB requests at 2.7 GB/s in
        # every process (docs/BENCHMARKS.md, "Zero-copy request size"). They cost no memory: the
        # bytes in flight are the caller's.
        direct_request = 2 * choice.native_kwargs()["block_size"]
        # pad_for(): sources of at least this many bytes are written zero-copy (0: never); the C
        # writer gets the same threshold (DISTCKPT_ZERO_COPY_MIN, at least one request).
        zero_copy_min = max(get_config().zero_copy_min, direct_request)
        self._zero_copy = zero_copy_min if choice.name != "buffered" and choice.mem_align else 0
        # Sink.hold_min: held zero-copy writes stay in flight after write_checksummed returns
        # (io_uring only: pwrite's are done when it returns).
        self.hold_min = self._zero_copy if choice.name == "uring" else 0
        self._mem_align = choice.mem_align
        self._offset_align = choice.offset_align
        self._size: int | None = None
        self._c = None
        self._fd = -1
        self._pos = 0
        try:
            if choice.name == "buffered":
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            else:
                # Sources aligned to mem_align (and >= one block) are written straight from the
                # caller's memory, no staging copy; write() still returns only when done.
                native = dict(choice.native_kwargs(), block_size=direct_request)
                cfg = get_config()
                self._c = _uring.Writer(
                    path,
                    **native,
                    # The staging ring, apart from the request size of zero-copy writes: it is
                    # the memory a save adds (DISTCKPT_STAGE_BLOCK x DISTCKPT_STAGE_BLOCKS).
                    stage_block=max(min(cfg.stage_block, native["block_size"]), choice.offset_align,
                                    os.sysconf("SC_PAGESIZE")),
                    stage_blocks=min(cfg.stage_blocks, native["queue_depth"] + 1),
                    zero_copy_min=zero_copy_min,
                    # Registered staging: pages pinned once, not per request (~5-10% on the copy
                    # path at 2 GB/s). If RLIMIT_MEMLOCK refuses it the C writer uses plain
                    # writes (self.fixed_buffers says which ran); the backend is unchanged.
                    fixed_buffers=True,
                )
        except OSError as exc:  # the C constructor released everything before raising
            raise from_os_error(exc, path=path, operation="open") from exc
        if self._c is not None and size_hint:
            try:
                self._c.reserve(size_hint)
            except OSError as exc:
                raise self._fail(exc, "fallocate") from exc

    # -- context manager ----------------------------------------------------------------------
    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()  # do not fsync (or mask the error) on the way out of a failure

    def __del__(self) -> None:  # last resort only; the C object also closes in its dealloc
        try:
            self.abort()
        except Exception:
            pass

    # -- writing ------------------------------------------------------------------------------
    @property
    def fixed_buffers(self) -> bool:
        """Whether the staging blocks are registered with the ring (an optimization only)."""
        return self._c is not None and self._c.fixed_buffers

    @property
    def closed(self) -> bool:
        return self._c is None and self._fd < 0

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"writer for {self.path} is closed")

    def _fail(self, exc: OSError, operation: str):
        self.abort()
        return from_os_error(exc, path=self.path, operation=operation)

    def write(self, data) -> int:
        """Append ``data`` (any C-contiguous buffer: bytes, bytearray, memoryview, array...).

        Returns:
            The new position (bytes written so far).

        Raises:
            StorageError subclass (DiskFullError, FileTooLargeError, StorageIOError...): the write
                failed; the writer is closed. With io_uring the error of a write still in flight
                may surface on a later ``write`` or on ``close``.
            BufferError: ``data`` is not contiguous.
            ValueError: the writer is closed.
        """
        self._check_open()
        try:
            if self._c is not None:
                self._pos = self._c.write(data)
            else:
                view = memoryview(data).cast("B")
                while view.nbytes:
                    n = os.write(self._fd, view)
                    view = view[n:]
                    self._pos += n
        except OSError as exc:
            raise self._fail(exc, "write") from exc
        return self._pos

    def write_checksummed(self, data, block: int, hold=None) -> tuple[int, ...]:
        """:meth:`write` ``data``, and return the crc32c of each ``block`` bytes of it (the last
        one partial; ``()`` for empty data), as ``manifest.block_crcs`` computes them. With an
        O_DIRECT backend the checksums are computed in C while the bytes are written (one pass
        over them, none while the disk waits). Raises what :meth:`write` raises.

        ``hold``: an object that keeps ``data``'s memory alive (the tensor it views). Given, the
        caller promises the bytes stay unchanged until :meth:`close`, and zero-copy writes from
        them may still be in flight when this returns (the writer keeps ``hold`` referenced until
        they are done; the next held call waits for them). Without it, nothing of ``data`` is
        referenced after return."""
        self._check_open()
        if self._c is None:
            view = memoryview(data).cast("B")
            crcs = tuple(_uring.crc32c(view[i:i + block]) for i in range(0, view.nbytes, block))
            self.write(view)
            return crcs
        try:
            self._pos, crcs = self._c.write_checksummed(data, block, hold)
        except OSError as exc:
            raise self._fail(exc, "write") from exc
        return crcs

    def pad_for(self, data, alignment: int | None = None) -> int:
        """Pad before a chunk whose bytes are ``data``, so that it can be written zero-copy, and
        return the chunk's offset: :meth:`pad_to` ``alignment``, and, when ``data`` is large
        enough for zero-copy writes but does not start on an O_DIRECT memory boundary (torch's
        large CPU tensors start 64 bytes past a page), a few more zero bytes (less than the
        offset alignment) so that its first aligned byte lands on an aligned file position:
        the writer stages the bytes before it and writes the rest straight from ``data``.
        Chunk offsets need no alignment (readers widen their reads). Raises like :meth:`write`."""
        pos = self.pad_to(alignment)
        n = memoryview(data).nbytes
        if self._zero_copy and n >= self._zero_copy + self._mem_align:
            head = -_uring.address(data) % self._mem_align
            extra = -head % self._offset_align
            if head and extra:
                self._check_open()
                try:
                    self._pos = pos = self._c.zeros(extra)
                except OSError as exc:
                    raise self._fail(exc, "write") from exc
        return pos

    def pad_to(self, alignment: int | None = None) -> int:
        """Append zero bytes up to the next multiple of ``alignment`` (default ``self.alignment``).

        Returns:
            The new position. Raises like :meth:`write`.
        """
        alignment = alignment or self.alignment
        if alignment <= 0:
            raise ValueError(f"alignment must be positive, not {alignment}")
        pad = -self._pos % alignment
        if pad:
            self._check_open()
            if self._c is not None:
                try:
                    self._pos = self._c.zeros(pad)
                except OSError as exc:
                    raise self._fail(exc, "write") from exc
            else:
                self.write(bytes(pad))
        return self._pos

    def tell(self) -> int:
        """Bytes appended so far (the offset the next ``write`` lands at)."""
        return self._pos

    def close(self) -> int:
        """Finish the file: write the tail, truncate to the exact size, fsync if durable, close.

        Idempotent: a second call returns the same size. After a failure (the writer already
        closed its fds and raised) it does nothing and returns ``tell()``, so a ``finally:
        w.close()`` never masks the original typed error.

        Returns:
            The final file size in bytes.

        Raises:
            StorageError subclass: operation "write" (tail / in-flight writes / truncate) or
                "fsync"; every fd is closed before it is raised.
        """
        if self._size is not None:
            return self._size
        if self.closed:  # aborted after an error that was already raised
            return self._pos
        operation = "write"
        try:
            if self._c is not None:
                self._c.flush()
                if self.durable:
                    operation = "fsync"
                    self._c.fsync()
                operation = "close"
                self._c.close()
                self._c = None
            else:
                if self.durable:
                    operation = "fsync"
                    os.fsync(self._fd)
                operation = "close"
                fd, self._fd = self._fd, -1
                os.close(fd)
        except OSError as exc:
            raise self._fail(exc, operation) from exc
        self._size = self._pos
        return self._size

    def abort(self) -> None:
        """Close every fd without flushing or fsyncing; the partial file stays. Idempotent."""
        c, self._c = self._c, None
        fd, self._fd = self._fd, -1
        if c is not None:
            try:
                c.close()
            except OSError:
                pass  # the fd is closed even when close() reports an error
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def open_writer(
    path: str | os.PathLike,
    *,
    choice: BackendChoice | None = None,
    durable: bool = True,
    size_hint: int | None = None,
) -> Writer:
    """Create ``path`` (which must not exist) and return a :class:`Writer` for it.

    Args:
        path: The new file.
        choice: The backend to use; default :func:`choose_backend` for the file's directory
            (honouring DISTCKPT_IO_BACKEND).
        durable: fsync in ``close()``.
        size_hint: The file's final size when known (the save plan knows it). The O_DIRECT
            backends then preallocate it in one fallocate: no step-wise growth (each step waits
            for the writes in flight), and a file that cannot fit fails at once with
            DiskFullError (operation "fallocate") instead of after writing most of it.
            ``close()`` still truncates to the bytes actually written.

    Raises:
        IOBackendUnavailableError: a forced backend cannot run here.
        StorageError subclass: creating the file failed (EEXIST gives a FileExistsError-like
            StorageError with errno EEXIST, EACCES a StoragePermissionError, ...). No fd remains.
    """
    path = os.fspath(path)
    ensure_sigxfsz_ignored()
    if choice is None:
        choice = choose_backend(os.path.dirname(os.path.abspath(path)))
    return Writer(path, choice, durable, size_hint)
