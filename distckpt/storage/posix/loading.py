"""The read side of a local checkpoint directory: is it committed, its MANIFEST, its data files,
and did it stay the same directory while a load read it.

What :class:`distckpt.storage.posix.store.PosixStore` serves to loads through the Store seam:

  * :func:`manifest_bytes`: the raw MANIFEST, after :func:`check_committed` has said what the path
    is when it is not a committed checkpoint (:mod:`distckpt.storage.posix.locate`).
  * :func:`data_readers`: every data file a load reads, checked with ``lstat`` (a regular file of
    the MANIFEST's size inside the checkpoint, never followed through a symlink: I7) before any
    byte is read, and readers on the backend chosen for the file system without writing to it.
  * :func:`guard_reads`: a rotation (a manager's ``keep_last``), an overwrite or a deletion renames
    a checkpoint directory away and deletes it; a load that read MANIFEST before that meets a
    missing file, a missing MANIFEST, or another directory's files under the same name. That is
    not damage, and "restore from an older checkpoint" is the wrong remedy: the guard checks the
    directory again and raises CheckpointRemovedError, which says what happened.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Any, Callable, Iterator, Mapping

from ... import manifest as mf
from ...errors import (CheckpointCorruptError, CheckpointIncompleteError, CheckpointNotFoundError,
                       CheckpointRemovedError, DataFileMissingError, StorageError, from_os_error)
from .leftovers import TMP_RE
from .locate import check_checkpoint_dir
from .manifests import check_data_file_stat, read_manifest_bytes
from .probe import choose_backend
from .reader import open_reader

__all__ = ["check_committed", "manifest_bytes", "check_data_file", "data_readers", "guard_reads", "identity", "raise_if_changed"]


def check_committed(path: str) -> None:
    """Raise unless ``path`` is a committed checkpoint directory's name (its MANIFEST is read next).

    Raises:
        CheckpointNotFoundError: nothing at ``path``, or something that is no checkpoint (named).
        CheckpointIncompleteError: a save's temporary directory, or data files without MANIFEST.
    """
    check_checkpoint_dir(path)  # names what the path is when it is not a checkpoint
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}", path=path)
    if TMP_RE.match(os.path.basename(path)):
        raise CheckpointIncompleteError(f"{path} is the temporary directory of an unfinished save", path=path)


def manifest_bytes(path: str) -> bytes:
    """The raw MANIFEST of the checkpoint directory ``path``, after :func:`check_committed`.

    Raises what :func:`check_committed` and
    :func:`distckpt.storage.posix.manifests.read_manifest_bytes` raise.
    """
    check_committed(path)
    return read_manifest_bytes(os.path.join(path, mf.MANIFEST_NAME))


def check_data_file(ckpt: str, entry: "mf.FileEntry") -> str:
    """The path of data file ``entry`` of the checkpoint ``ckpt``, once ``lstat`` has shown it to
    be a regular file of the MANIFEST's size.

    Raises:
        DataFileMissingError: it does not exist.
        DataFileTruncatedError, CheckpointCorruptError: another size, or not a regular file.
        StorageError: (a subclass) the ``lstat`` failed otherwise.
    """
    fpath = os.path.join(ckpt, entry.name)
    try:
        # lstat, not stat: a data file must be a regular file inside the checkpoint (I7), never
        # followed through a symlink; refused before any open or read.
        st = os.lstat(fpath)
    except FileNotFoundError:
        raise DataFileMissingError(f"data file {entry.name} listed in MANIFEST is missing", path=fpath) from None
    except OSError as exc:
        raise from_os_error(exc, path=fpath, operation="stat") from exc
    check_data_file_stat(entry, fpath, st)
    return fpath


def data_readers(path: str, manifest: "mf.Manifest", file_indexes: list[int], *,
                 piece: int | None = None) -> tuple[Mapping[int, str], Callable[[str], Any], int, str]:
    """``(paths, open_reader, align, backend)`` for :func:`distckpt.fill.fill`: the data files
    ``file_indexes`` of the checkpoint at ``path``, each checked by :func:`check_data_file`, and
    readers on the backend chosen for its file system (read-only: a load never writes into the
    checkpoint, not even a probe file) whose largest single request is ``piece`` bytes. Raises
    what :func:`check_data_file` raises, and IOBackendUnavailableError when a forced backend
    cannot run here."""
    choice = choose_backend(path, read_only=True)
    paths = {i: check_data_file(path, manifest.files[i]) for i in file_indexes}
    return (paths, lambda p: open_reader(p, choice=choice, block_size=piece), choice.offset_align,
            choice.name)


def identity(path: str) -> tuple | None:
    """What tells one checkpoint directory at ``path`` from another that took its name: the
    directory's (st_dev, st_ino), then ``"manifest"`` and its MANIFEST's inode, size and trailing
    crc32c, or for a directory without a MANIFEST (a DCP or Hugging Face checkpoint) ``"files"``
    and its files' names, inodes, sizes and times (:func:`_files_identity`). None when nothing is
    at ``path``.

    The directory's inode alone is not enough: a file system reuses a freed inode number at once
    (ext4 does), so a directory deleted by an overwrite and the one the next save publishes can
    share it; their MANIFESTs' checksums differ (every save's body has its own save id). A
    foreign checkpoint has no such record of its files, and no checksums: a file replaced by
    another of the same size between its header's read and its data's was read at the old
    offsets, silently (an outside trial swapped two tensors that way)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    manifest = _manifest_identity(os.path.join(path, mf.MANIFEST_NAME))
    if manifest is not None:
        return st.st_dev, st.st_ino, "manifest", manifest
    return st.st_dev, st.st_ino, "files", _files_identity(path)


#: The files of a DCP or Hugging Face checkpoint directory that a load reads: its metadata and
#: data files. Others beside them (a trainer's state, a config, a subdirectory of a later
#: checkpoint) may change during a load without a false alarm (an outside trial).
_FOREIGN_SUFFIXES = (".safetensors", ".distcp", ".safetensors.index.json")


def _files_identity(path: str) -> tuple | None:
    """(name, inode, size, mtime_ns, ctime_ns) of every data or metadata file of the foreign
    checkpoint directory ``path`` (:data:`_FOREIGN_SUFFIXES`, ``.metadata``), sorted; None when it
    cannot be listed. The change time catches a rewrite that kept the modification time (``cp
    -p``, ``rsync -t``, tar extraction)."""
    try:
        with os.scandir(path) as it:
            out = []
            for entry in it:
                if entry.name != ".metadata" and not entry.name.endswith(_FOREIGN_SUFFIXES):
                    continue
                st = entry.stat(follow_symlinks=False)
                out.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    except OSError:
        return None
    return tuple(sorted(out))


def _manifest_identity(path: str) -> tuple[int, int, bytes] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return st.st_ino, st.st_size, os.pread(fd, 4, max(0, st.st_size - 4)) if stat.S_ISREG(st.st_mode) else b""
    except OSError:
        return None
    finally:
        os.close(fd)


def _removed_while_reading(path: str, before: tuple | None,
                           exc: BaseException | None) -> BaseException | None:
    """``exc``, or a CheckpointRemovedError when ``exc`` is what a step vanishing mid-load looks like
    (``exc`` None: a load that succeeded, failed only if another directory took the name).
    ``before`` is the directory's :func:`identity` when the load began. ESTALE: a data
    file replaced between the two opens of its reader (:mod:`distckpt.storage.posix.reader`)."""
    suspect = exc is None or isinstance(exc, (CheckpointIncompleteError, CheckpointCorruptError)) or (
        isinstance(exc, StorageError) and exc.errno in (errno.ENOENT, errno.ESTALE))
    if not suspect or isinstance(exc, CheckpointNotFoundError):
        return exc
    now = identity(path)
    if now is not None and (before is None or now == before):
        return exc  # still the same directory: the error (or success) stands as it is
    if exc is None and now is None:
        return None  # read in full, then removed: every byte came from the one checkpoint
    parent, name = os.path.split(path)
    renamed_to = None
    if before is not None:
        try:
            with os.scandir(parent) as it:
                for entry in it:
                    m = TMP_RE.match(entry.name)
                    if m and m.group("name") == name:
                        st = entry.stat(follow_symlinks=False)
                        if (st.st_dev, st.st_ino) == before[:2]:
                            renamed_to = entry.path
                            break
        except OSError:
            pass
    changed = now is not None and before is not None and now[:3] == before[:3] and now[2] == "files"
    if changed:
        how = "its files were replaced or changed (a DCP or Hugging Face checkpoint: no MANIFEST records them)"
    elif now is not None:
        how = "another directory now has its name (it was overwritten, or rotated away and saved again)"
    elif renamed_to is not None:
        how = f"it was renamed to {os.path.basename(renamed_to)} to be deleted (rotation by a manager's keep_last, or an overwrite)"
    else:
        how = "the directory no longer exists (rotated away or deleted)"
    if exc is None:  # every read succeeded, but not necessarily all from one checkpoint
        failed = ("its files may have been read partly from the one that replaced it, so the load is "
                  "failed rather than mixing two checkpoints")
    else:
        failed = f"the read failed with {type(exc).__name__}: {getattr(exc, 'message', exc)}"
    # A load's failed fill says which tensors hold verified bytes already: so does this error.
    fields = {k: getattr(exc, k) for k in ("filled", "partly_filled") if getattr(exc, k, None) is not None}
    removed = CheckpointRemovedError(
        f"the checkpoint at {path} {'changed' if changed else 'was removed'} while it was being read: {how}; {failed}",
        path=path, rank=getattr(exc, "rank", None), renamed_to=renamed_to, replaced=now is not None, **fields)
    removed.__cause__ = exc
    return removed


def raise_if_changed(path: str, before: tuple | None) -> None:
    """Raise CheckpointRemovedError when the directory at ``path`` is no longer what
    :func:`identity` found (``before``): removed, replaced, or its files changed (a DCP or
    Hugging Face directory). For a reader that must not act on a mix (convert, before it
    publishes)."""
    error = _removed_while_reading(path, before, None)
    if error is not None:
        raise error


@contextlib.contextmanager
def guard_reads(path: str) -> Iterator[None]:
    """Around every read of the checkpoint directory ``path``: an error raised inside that is what
    the directory's removal or replacement mid-read looks like (a missing or damaged file of a
    directory that no longer has its name) leaves as CheckpointRemovedError, its cause kept.

    Data files are opened by path, one after another: if another checkpoint took the name
    meanwhile, some of them may be the new one's, which checksums catch unless the bytes agree or
    the load does not verify. So a block that succeeded raises CheckpointRemovedError too when
    another directory has the name at its end (one removed after every read is fine: each byte
    came from the one checkpoint)."""
    before = identity(path)
    try:
        yield
    except Exception as exc:
        removed = _removed_while_reading(path, before, exc)
        if removed is exc:
            raise
        raise removed from exc
    error = _removed_while_reading(path, before, None)
    if error is not None:
        raise error
