"""Ranged readers for restore: many (offset, length) reads into caller-provided buffers.

Invariants:
  * Every request is checked against the file size before any I/O: a range past EOF raises
    :class:`DataFileTruncatedError` (``expected`` = end of the range, ``found`` = file size).
  * Reads run ``queue_depth`` in flight (io_uring) and go straight into the destination when its
    address and offset are aligned for O_DIRECT and it has room for the length rounded up to the
    alignment (a ``dest`` may be longer than ``nbytes``); otherwise through aligned staging.
  * Page cache first: with an O_DIRECT backend, a request whose pages are all in the page cache
    (cachestat, else mincore) is read with a buffered pread from a second fd on the same inode
    (the disk is not touched again). The rest are read through the cache too (buffered, filling
    it for the next load) when ``through_cache`` (by default :func:`readcache.reads_through_cache`
    of the file's size: what fits the cache), else with O_DIRECT, which never fills the cache.
    ``cached_bytes`` / ``buffered_bytes`` / ``direct_bytes`` count which way the bytes came.
  * Every OSError is translated by :func:`errors.from_os_error` (operation "open"/"read") after
    the reader closed its fds; after ``close()`` the reader holds no fd.
"""

from __future__ import annotations

import errno
import os
from typing import Iterable, Sequence

from ... import _uring
from ...errors import DataFileTruncatedError, from_os_error
from .probe import BackendChoice, choose_backend
from .readcache import reads_through_cache

__all__ = ["Reader", "open_reader"]


class Reader:
    """Reads byte ranges of one file. Use :func:`open_reader` to make one.

    Attributes:
        path: The file.
        backend: "uring", "pwrite" (synchronous O_DIRECT pread) or "buffered".
        size: The file size when it was opened.
        through_cache: Uncached pages are read through the page cache (buffered) rather than
            with O_DIRECT (always True for the "buffered" backend).
    """

    def __init__(self, path: str, choice: BackendChoice, *, block_size: int | None = None,
                 use_cache: bool = True, through_cache: bool | None = None) -> None:
        self.path = path
        self.backend = choice.name
        self.cached_bytes = 0
        self.buffered_bytes = 0
        self.direct_bytes = 0
        self.through_cache = choice.name == "buffered"  # decided below, once the size is known
        self._c = None
        self._fd = -1
        self._use_cache = use_cache and choice.name != "buffered"
        try:
            # O_NOFOLLOW: a data file is a regular file inside its checkpoint (docs/DESIGN.md I7);
            # restore checks that with lstat first, and this closes the race after the check
            # (a symlink swapped in fails with ELOOP). The buffered fd is opened first: with an
            # O_DIRECT backend it serves cached pages, and must be the same inode as the C
            # reader's (checked below).
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            st = os.fstat(self._fd)
            self.size = st.st_size
            if choice.name != "buffered" and use_cache:
                self.through_cache = (reads_through_cache(self.size) if through_cache is None
                                      else bool(through_cache))
            if choice.name != "buffered":
                kwargs = choice.native_kwargs()
                if block_size is not None:
                    kwargs["block_size"] = max(block_size, choice.offset_align, os.sysconf("SC_PAGESIZE"))
                self._c = _uring.Reader(path, **kwargs)  # opens O_NOFOLLOW too
                other = os.fstat(self._c.fileno)
                if (other.st_dev, other.st_ino) != (st.st_dev, st.st_ino):
                    raise OSError(errno.ESTALE, "data file was replaced while it was being opened", path)
        except OSError as exc:
            self.close()
            raise from_os_error(exc, path=path, operation="open") from exc

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @property
    def closed(self) -> bool:
        return self._c is None and self._fd < 0

    def read_into(self, requests: Iterable[tuple[int, int, object]]) -> None:
        """Fill every ``dest`` with the file's bytes ``[offset, offset + nbytes)``.

        Args:
            requests: ``(file_offset, nbytes, dest)`` triples; ``dest`` is a writable, contiguous
                buffer (bytearray, memoryview, ctypes array...) of at least ``nbytes`` bytes; the
                bytes land in its first ``nbytes`` (a longer, aligned ``dest`` lets an unaligned
                tail go straight in with O_DIRECT; what follows the tail is unspecified).

        Raises:
            DataFileTruncatedError: a range ends past EOF (checked before any I/O; the reader stays
                open), or the file shrank while reading (the reader is closed).
            ValueError: a ``dest`` has the wrong size or the reader is closed.
            StorageError subclass: the read failed (EIO...); the reader is closed.
        """
        if self.closed:
            raise ValueError(f"reader for {self.path} is closed")
        reqs: Sequence = list(requests)
        for offset, nbytes, dest in reqs:
            if offset < 0 or nbytes < 0:
                raise ValueError(f"bad request offset={offset} nbytes={nbytes}")
            if offset + nbytes > self.size:
                raise DataFileTruncatedError(
                    f"data file is {self.size} bytes, a read needs bytes up to {offset + nbytes}",
                    path=self.path, expected=offset + nbytes, found=self.size,
                )
        try:
            direct = reqs
            if self._use_cache:
                direct = []
                for req in reqs:
                    cached, total = _uring.cached_pages(self._fd, req[0], req[1])
                    if req[1] and cached == total:
                        self._pread_into(*req)
                        self.cached_bytes += req[1]
                    elif self.through_cache:
                        self._pread_into(*req)
                        self.buffered_bytes += req[1]
                    else:
                        direct.append(req)
            if self._c is not None:
                if direct:
                    self._c.read_into(direct)
                    self.direct_bytes += sum(n for _, n, _ in direct)
            else:  # the buffered backend
                for offset, nbytes, dest in direct:
                    self._pread_into(offset, nbytes, dest)
                    self.buffered_bytes += nbytes
        except EOFError as exc:
            found = self._current_size()
            self.close()
            raise DataFileTruncatedError(
                f"data file shrank while reading: {exc}; it is now {found} bytes",
                path=self.path, expected=max(o + n for o, n, _ in reqs), found=found,
            ) from exc
        except OSError as exc:
            self.close()
            raise from_os_error(exc, path=self.path, operation="read") from exc

    @property
    def supports_fill(self) -> bool:
        """True when :meth:`fill_segments` can run (an O_DIRECT backend; not the buffered one)."""
        return self._c is not None

    def fill_segments(self, buffer, slot: int, segments: bytes, checks: bytes, copies: bytes, dests: bytes,
                      done: bytearray):
        """Run the C read pipeline (``_uring.Reader.fill``, see csrc/reader.c): read every segment
        into a slot of ``buffer`` (every free slot's read in flight; a segment whose pages are all
        cached is read with a buffered pread instead, and with ``through_cache`` the others are
        buffered reads in flight rather than O_DIRECT ones), check its crc32c blocks, and only then copy
        its byte runs into the destinations. ``done[i]`` becomes 1 once segment ``i`` was copied.

        Returns None, or ``(segment, check, crc found)`` for the first checksum mismatch (nothing
        of that segment, and nothing after it, was copied).

        Raises:
            ValueError: the packed plan does not fit the buffer, the reads or the destinations
                (checked before any I/O), or the reader is closed / has no O_DIRECT backend.
            DataFileTruncatedError: the file ended before a segment's bytes (the reader is closed).
            StorageError subclass: a read failed (the reader is closed).
        """
        if self._c is None:
            raise ValueError(f"reader for {self.path} is closed or has no O_DIRECT backend")
        try:
            cached, direct, buffered, bad = self._c.fill(buffer, slot, segments, checks, copies, dests, done,
                                                         self._fd if self._use_cache else -1,
                                                         self.through_cache and self._use_cache)
        except EOFError as exc:
            found = self._current_size()
            self.close()
            raise DataFileTruncatedError(
                f"data file shrank while reading: {exc}; it is now {found} bytes",
                path=self.path, expected=self.size, found=found,
            ) from exc
        except OSError as exc:
            self.close()
            raise from_os_error(exc, path=self.path, operation="read") from exc
        self.cached_bytes += cached
        self.buffered_bytes += buffered
        self.direct_bytes += direct
        return bad

    def _pread_into(self, offset: int, nbytes: int, dest) -> None:
        view = memoryview(dest).cast("B")
        if view.nbytes < nbytes:
            raise ValueError(f"dest has {view.nbytes} bytes, nbytes is {nbytes}")
        view = view[:nbytes]
        done = 0
        while done < nbytes:
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise EOFError(f"short read: wanted bytes up to offset {offset + nbytes}")
            done += n

    def _current_size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except OSError:
            return -1

    def close(self) -> None:
        """Release the fd(s) and staging. Idempotent."""
        c, self._c = self._c, None
        fd, self._fd = self._fd, -1
        if c is not None:
            c.close()
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def open_reader(path: str | os.PathLike, *, choice: BackendChoice | None = None, block_size: int | None = None,
                use_cache: bool = True, through_cache: bool | None = None) -> Reader:
    """Open ``path`` for ranged reads with the backend chosen for its file system.

    ``block_size``: the largest single O_DIRECT request (default DISTCKPT_BLOCK_SIZE); a request
    is split into pieces of this size that run in parallel. ``use_cache=False``: never read
    through the page cache, even where the pages are cached (benchmarks of cold reads).
    ``through_cache``: read uncached pages through the cache (True) or with O_DIRECT (False);
    None (default): :func:`readcache.reads_through_cache` of the file's size.

    Raises:
        IOBackendUnavailableError: a forced backend cannot run here.
        StorageError subclass: the open failed (ENOENT gives a StorageError with errno ENOENT).
    """
    path = os.fspath(path)
    if choice is None:
        choice = choose_backend(os.path.dirname(os.path.abspath(path)), read_only=True)  # reading writes nothing
    return Reader(path, choice, block_size=block_size, use_cache=use_cache, through_cache=through_cache)
