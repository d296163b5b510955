"""Path-level durability primitives: atomic exchange and fsync of a file or directory.

Invariant: every OSError is translated by :func:`errors.from_os_error`, and no fd outlives a call.
"""

from __future__ import annotations

import os

from ... import _uring
from ...errors import from_os_error

__all__ = ["exchange_paths", "fsync_path"]


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """Atomically swap ``a`` and ``b`` (renameat2 RENAME_EXCHANGE); both must exist.

    Used to overwrite a committed checkpoint directory atomically: readers see the old or the new
    one, never neither. The caller fsyncs the parent directory afterwards.

    Raises:
        StorageError subclass with errno: ENOENT (one is missing), EINVAL (the file system does not
            support RENAME_EXCHANGE), EXDEV (different file systems), EACCES/EPERM/EROFS...
    """
    try:
        _uring.rename_exchange(os.fspath(a), os.fspath(b))
    except OSError as exc:
        raise from_os_error(exc, path=os.fspath(a), operation="rename") from exc


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (to make a rename or a new entry in it durable).

    Raises:
        StorageError subclass: operation "open" or "fsync" (EIO gives StorageIOError, never retried).
    """
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise from_os_error(exc, path=path, operation="open") from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        raise from_os_error(exc, path=path, operation="fsync") from exc
    os.close(fd)
