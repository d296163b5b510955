"""A local checkpoint's MANIFEST and data-file indexes, read with the checks of I7.

The POSIX read side below :class:`distckpt.storage.posix.store.PosixStore`: a MANIFEST is opened
without following a symlink and refused when it is not a regular file or larger than the format
allows; a data file is checked (regular, exact size) before its index is read. The byte format
itself (encode, decode, validate) is :mod:`distckpt.manifest`; nothing here writes.
"""

from __future__ import annotations

import errno
import os
import stat

from ... import manifest as mf
from ...errors import (CheckpointCorruptError, CheckpointIncompleteError, DataFileMissingError,
                       DataFileTruncatedError, ManifestCorruptError, from_os_error)
from .leftovers import TMP_RE

__all__ = ["is_committed", "read_manifest_bytes", "manifest_file", "load_manifest", "load_manifest_header", "check_data_file_stat",
           "read_local_index", "peek_commit_time"]


def _corrupt(message: str, path: str) -> ManifestCorruptError:
    return ManifestCorruptError(f"MANIFEST {message}", path=path)


def is_committed(path: str) -> bool:
    """True when ``path`` is a committed checkpoint directory (it has its MANIFEST and is not a
    hidden tmp/del directory).

    Raises StorageError (a subclass, via from_os_error) when the look itself fails: a directory
    that cannot be entered (EACCES, an NFS error) may well hold a committed step, and answering
    False made a manager skip it, load the step before it and then delete it as an abandoned
    branch. Only "nothing there" (ENOENT, ENOTDIR) and a MANIFEST symlink loop (never a
    checkpoint: its MANIFEST is never followed) are False."""
    if TMP_RE.match(os.path.basename(os.path.normpath(path))):
        return False
    manifest = os.path.join(path, mf.MANIFEST_NAME)
    try:
        st = os.stat(manifest)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return False
        raise from_os_error(exc, path=manifest, operation="stat MANIFEST") from exc
    return stat.S_ISREG(st.st_mode)


def read_manifest_bytes(path: str | os.PathLike) -> bytes:
    """Read a MANIFEST file whole, refusing anything larger than the format allows.

    Raises:
        CheckpointIncompleteError: the file does not exist (the directory was never committed).
        ManifestCorruptError: it is not a regular file (a symlink, which is never followed, a
            FIFO, a directory), or larger than the limit.
        StorageError: (a subclass, via from_os_error) any other OS error while reading.
    """
    path = os.fspath(path)
    limit = mf.MAX_MANIFEST_FILE_BYTES
    try:
        # O_NONBLOCK: a FIFO planted as MANIFEST must not block the open; the S_ISREG check
        # below then refuses it (regular files ignore O_NONBLOCK). O_NOFOLLOW: a symlink named
        # MANIFEST could point anywhere; loading never opens a file outside the checkpoint (I7).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CheckpointIncompleteError(
            f"no {mf.MANIFEST_NAME} at {path}: this directory is not a committed checkpoint", path=path
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _corrupt("is a symbolic link, not a regular file inside the checkpoint directory "
                           "(it is not followed: it could point anywhere)", path) from None
        raise from_os_error(e, path=path, operation="open MANIFEST") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _corrupt("is not a regular file", path)
        if st.st_size > limit:
            raise _corrupt(f"is {st.st_size} bytes, larger than the {limit}-byte limit", path)
        # The whole file in one read, into one buffer of its size (reading in parts and joining
        # them held it twice: 2 GiB for a MANIFEST declaring the largest body); then read on to
        # EOF, never past the limit even if the file grows.
        first = os.read(fd, st.st_size + 1)
        parts, got = [first], len(first)
        while first and got <= limit:
            part = os.read(fd, min(limit + 1 - got, 1 << 24))
            if not part:
                break
            parts.append(part)
            got += len(part)
        if got > limit:
            raise _corrupt(f"is larger than the {limit}-byte limit", path)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    except OSError as e:
        raise from_os_error(e, path=path, operation="read MANIFEST") from e
    finally:
        os.close(fd)


def manifest_file(path: str | os.PathLike) -> str:
    """The MANIFEST file of ``path``: the file itself, or the one in the directory ``path``."""
    path = os.fspath(path)
    return os.path.join(path, mf.MANIFEST_NAME) if os.path.isdir(path) else path


def load_manifest(path: str | os.PathLike) -> mf.Manifest:
    """Read and decode a MANIFEST; ``path`` is the file or the checkpoint directory holding it.
    A version-3 MANIFEST's chunk records are read from the data files' indexes next to it.

    Raises:
        CheckpointIncompleteError: there is no MANIFEST.
        ManifestCorruptError, ChecksumMismatchError: see :func:`distckpt.manifest.decode`.
        DataFileMissingError, DataFileTruncatedError, CheckpointCorruptError: see
            :func:`read_local_index`.
    """
    path = manifest_file(path)
    directory = os.path.dirname(path)
    return mf.decode(read_manifest_bytes(path), path=path,
                  read_index=lambda header, i: read_local_index(directory, header.files[i]))


def load_manifest_header(path: str | os.PathLike) -> mf.Manifest:
    """:func:`distckpt.manifest.decode_header` of the MANIFEST at ``path`` (the file or its directory): its own
    fields, no data file read (a version-3 manifest's tensors have ``chunks`` None).

    Raises:
        CheckpointIncompleteError: there is no MANIFEST.
        ManifestCorruptError: see :func:`distckpt.manifest.decode_header`.
    """
    path = manifest_file(path)
    return mf.decode_header(read_manifest_bytes(path), path=path)


def check_data_file_stat(entry: mf.FileEntry, fpath: str, st: os.stat_result) -> None:
    """The checks a reader makes of a data file before reading a byte of it, on its ``lstat`` or
    ``fstat`` ``st``: a regular file (a symlink could point anywhere, an identical copy outside
    passes every checksum: I7) of exactly the size the MANIFEST gives.

    Raises:
        CheckpointCorruptError: not a regular file, or longer than the MANIFEST says.
        DataFileTruncatedError: shorter than the MANIFEST says.
    """
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "not a file"
        raise _not_regular(entry, fpath, kind)
    if st.st_size < entry.size:
        raise DataFileTruncatedError(f"data file {entry.name} has {st.st_size} bytes, MANIFEST says {entry.size}",
                                     path=fpath, expected=entry.size, found=st.st_size)
    if st.st_size > entry.size:
        raise CheckpointCorruptError(f"data file {entry.name} has {st.st_size} bytes, MANIFEST says {entry.size}",
                                     path=fpath, expected=entry.size, found=st.st_size)


def _not_regular(entry: mf.FileEntry, fpath: str, kind: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"data file {entry.name} listed in MANIFEST must be a regular file inside the checkpoint, found {kind}",
        path=fpath, expected="regular file", found=kind,
        remedy="Restore the checkpoint's data files as plain files (copy with symlinks dereferenced), "
               "or load an older checkpoint.")


def read_local_index(directory: str, entry: mf.FileEntry) -> bytes:
    """The index bytes of data file ``entry`` in the checkpoint ``directory`` (version 3).

    The file must be a regular file (never a symlink: I7) of exactly ``entry.size`` bytes, the
    checks a load makes before it reads a data file.

    Raises:
        DataFileMissingError: the file does not exist.
        DataFileTruncatedError: it is shorter than the MANIFEST says.
        CheckpointCorruptError: it is longer, or not a regular file.
        StorageError: (a subclass, via from_os_error) any other OS error.
    """
    fpath = os.path.join(directory, entry.name)
    off, length, _ = entry.index
    try:
        fd = os.open(fpath, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise DataFileMissingError(f"data file {entry.name} listed in MANIFEST is missing", path=fpath) from None
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW on a symlink: refused as check_data_file_stat does
            raise _not_regular(entry, fpath, "a symlink") from None
        raise from_os_error(e, path=fpath, operation="open data file") from e
    try:
        check_data_file_stat(entry, fpath, os.fstat(fd))
        parts, got = [], 0
        while got < length:
            part = os.pread(fd, min(length - got, 1 << 24), off + got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)
    except OSError as e:
        raise from_os_error(e, path=fpath, operation="read") from e
    finally:
        os.close(fd)


def peek_commit_time(path: str | os.PathLike, *, prefix: int = 4096) -> float | None:
    """The commit time (``created_unix``) the MANIFEST at ``path`` (the file or its checkpoint
    directory) claims, from its first ``prefix`` bytes only (:func:`distckpt.manifest.commit_time_of_prefix`:
    no checksum, no validation). Returns None when those bytes do not tell (absent, not a regular
    file, a symlink, a bad header, the key not within the prefix). Never raises for a damaged
    file; never follows a symlink."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, mf.MANIFEST_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.pread(fd, prefix, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return mf.commit_time_of_prefix(data)
