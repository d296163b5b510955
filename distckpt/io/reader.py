"""Ranged readers for restore: many (offset, length) reads into caller-provided buffers.

Invariants:
  * Every request is checked against the file size before any I/O: a range past EOF raises
    :class:`DataFileTruncatedError` (``expected`` = end of the range, ``found`` = file size).
  * Reads run ``queue_depth`` in flight (io_uring) and go straight into the destination when its
    address, offset and length are all aligned for O_DIRECT; otherwise through aligned staging.
  * Every OSError is translated by :func:`errors.from_os_error` (operation "open"/"read") after
    the reader closed its fds; after ``close()`` the reader holds no fd.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from .. import _uring
from ..errors import DataFileTruncatedError, from_os_error
from .probe import BackendChoice, choose_backend

__all__ = ["Reader", "open_reader"]


class Reader:
    """Reads byte ranges of one file. Use :func:`open_reader` to make one.

    Attributes:
        path: The file.
        backend: "uring", "pwrite" (synchronous O_DIRECT pread) or "buffered".
        size: The file size when it was opened.
    """

    def __init__(self, path: str, choice: BackendChoice) -> None:
        self.path = path
        self.backend = choice.name
        self._c = None
        self._fd = -1
        try:
            if choice.name == "buffered":
                # O_NOFOLLOW: a data file is a regular file inside its checkpoint (DESIGN.md I7);
                # restore checks that with lstat first, and this closes the race after the check
                # (a symlink swapped in fails with ELOOP).
                self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                self.size = os.fstat(self._fd).st_size
            else:
                self._c = _uring.Reader(path, **choice.native_kwargs())  # opens O_NOFOLLOW too
                self.size = self._c.size()
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
                buffer (bytearray, memoryview, ctypes array...) of exactly ``nbytes`` bytes.

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
            if self._c is not None:
                self._c.read_into(reqs)
            else:
                for offset, nbytes, dest in reqs:
                    self._pread_into(offset, nbytes, dest)
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

    def _pread_into(self, offset: int, nbytes: int, dest) -> None:
        view = memoryview(dest).cast("B")
        if view.nbytes != nbytes:
            raise ValueError(f"dest has {view.nbytes} bytes, nbytes is {nbytes}")
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


def open_reader(path: str | os.PathLike, *, choice: BackendChoice | None = None) -> Reader:
    """Open ``path`` for ranged reads with the backend chosen for its file system.

    Raises:
        IOBackendUnavailableError: a forced backend cannot run here.
        StorageError subclass: the open failed (ENOENT gives a StorageError with errno ENOENT).
    """
    path = os.fspath(path)
    if choice is None:
        choice = choose_backend(os.path.dirname(os.path.abspath(path)), read_only=True)  # reading writes nothing
    return Reader(path, choice)
