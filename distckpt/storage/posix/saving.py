"""The POSIX side of a save, below the commit protocol (distckpt.commit): what a rank writes
and what rank 0 prepares in a local directory (leftovers are reclaimed by
:mod:`distckpt.storage.posix.leftovers`).

* :func:`prepare_save_dir` (PREPARE, rank 0): reclaim dead leftovers of the name, take the save
  lock, refuse a committed or foreign target, check the space, create ``.NAME.tmp-<save id>``.
* :func:`write_rank_file` (WRITE, every rank): one rank's data file, laid out by
  :mod:`distckpt.datafile` through the O_DIRECT writer, durable when it returns.
* :func:`copy_rank_file` (WRITE from existing bytes, a drain): a data file whose bytes a caller
  streams in, through the same writer, durable when it returns, unlinked on error.

:class:`distckpt.storage.posix.store.PosixStore` calls these; nothing here calls back up into the
commit protocol (the save's collectives live there, the file system's work here).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

from ... import datafile
from ...config import get_config
from ...errors import CheckpointCorruptError, CheckpointExistsError, DataFileTruncatedError, from_os_error
from . import commit as local
from . import savelock
from .guards import check_save_space, refuse_pseudo_fs
from .leftovers import lock_file, reclaim_tmp_dirs
from .manifests import is_committed
from .probe import choose_backend
from .writer import open_writer

__all__ = ["prepare_save_dir", "write_rank_file", "copy_rank_file"]


# PREPARE (rank 0)


def prepare_save_dir(final_dir: str, save_id: str, overwrite: bool, needed: int, rank: int,
             lock_path: str | None = None) -> tuple[str, Any]:
    """Reclaim dead leftovers of this name, take the save lock, check the target and the space,
    create the tmp dir. Returns (tmp dir, the held lock); on error the lock is released."""
    parent, name = os.path.split(os.path.abspath(final_dir))
    refuse_pseudo_fs(parent, rank=rank)
    local.make_dirs_durable(parent)
    _check_name_length(parent, name, rank)
    # Reclaim before locking: while we hold our own lock every leftover of the name looks alive.
    reclaim_tmp_dirs(parent, name)
    lock = savelock.acquire(lock_path or lock_file(parent, name), save_id=save_id, what=final_dir)
    try:
        return _prepare_locked(final_dir, parent, name, save_id, overwrite, needed, rank), lock
    except BaseException:
        lock.release()
        raise


# What a save adds to a checkpoint's name for its siblings: ".NAME.tmp-<32 hex>" (and ".del-").
_SIBLING_EXTRA = len(".") + len(".tmp-") + 32


def _check_name_length(parent: str, name: str, rank: int) -> None:
    """Raise ConfigError when ``name`` or its save's hidden siblings would not fit the file system's
    names (they add 38 bytes): the file system's ENAMETOOLONG would name the sibling, and "each name
    must be at most 255 bytes" would be no help for a name of 230."""
    from ...errors import ConfigError
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    size = len(os.fsencode(name))
    if size + _SIBLING_EXTRA > name_max:
        raise ConfigError(
            f"the checkpoint name {name[:40]!r}... is {size} bytes; a save also creates .NAME.tmp-<32 hex> beside it "
            f"({_SIBLING_EXTRA} bytes more), so on this file system (names of at most {name_max} bytes) a "
            f"checkpoint name may have at most {name_max - _SIBLING_EXTRA} bytes", path=os.path.join(parent, name),
            rank=rank, remedy=f"Shorten the checkpoint's name to at most {name_max - _SIBLING_EXTRA} bytes.")


def _prepare_locked(final_dir: str, parent: str, name: str, save_id: str, overwrite: bool, needed: int,
                    rank: int) -> str:
    if os.path.lexists(final_dir):
        if not is_committed(final_dir):
            try:
                empty = os.path.isdir(final_dir) and not os.listdir(final_dir)
                if empty:
                    os.rmdir(final_dir)  # an empty directory the user made for us
            except OSError as exc:
                raise from_os_error(exc, path=final_dir, operation="replace empty directory") from exc
            if not empty:
                # overwrite=True replaces a committed distckpt checkpoint only: removing a directory
                # distckpt did not write could take files it knows nothing of
                dcp_dir = os.path.isfile(os.path.join(final_dir, ".metadata"))
                what = ("a torch.distributed.checkpoint directory (DCP's .metadata), not a distckpt checkpoint"
                        if dcp_dir else "not a distckpt checkpoint (no MANIFEST)")
                raise CheckpointExistsError(
                    f"{final_dir} exists and is {what}; refusing to replace it (overwrite=True replaces only a "
                    f"committed distckpt checkpoint)", path=final_dir, rank=rank,
                    remedy="Choose another path or remove it yourself" + (
                        " (distckpt.read/load and DistCkptStorageReader read it, if you need it first)."
                        if dcp_dir else "."))
        elif not overwrite:
            raise CheckpointExistsError(f"a committed checkpoint already exists at {final_dir}",
                                        path=final_dir, rank=rank)
    if get_config().preflight:
        check_save_space(parent, needed, rank=rank)
    tmp_dir = os.path.join(parent, f".{name}.tmp-{save_id}")
    local.make_dir(tmp_dir)
    return tmp_dir


# WRITE (every rank)


def write_rank_file(path: str, rank: int, pieces: list[tuple[str, Any]], checksum_block: int):
    """Write this rank's owned pieces into one data file, laid out by :mod:`distckpt.datafile`
    (chunks, block checksums, the index last) through the O_DIRECT writer, which is the layout's
    sink: a page-aligned source goes to the disk straight from its memory, anything else through
    the aligned staging ring, the checksums computed in C while the writes are in flight.
    Returns ((index offset, length, crc32c), size, backend choice); the file is durable when this
    returns.

    Raises:
        StorageError subclasses of the writer (DiskFullError at the fallocate or a write,
            StorageIOError, ...); the partly written file is left for the caller's abort.
    """
    choice = choose_backend(os.path.dirname(path))
    # One fallocate up front (ext4 serializes O_DIRECT writes that extend a file) and an immediate
    # DiskFullError if the file cannot fit; close() truncates to what was written.
    size_hint = datafile.size_bound(pieces, checksum_block, choice.alignment, moves_chunks=True)
    with open_writer(path, choice=choice, durable=True, size_hint=size_hint) as w:
        written = datafile.write_data_file(w, rank, pieces, checksum_block)
        w.close()  # fsync: durable before the save may commit
    return written.index, written.size, choice


def copy_rank_file(path: str, size: int, feed: Callable[[Any], None]) -> int:
    """Create the data file ``path`` from bytes that ``feed(writer)`` appends with
    ``writer.write`` (exactly ``size`` of them), through the O_DIRECT writer (one fallocate of
    ``size`` first), fsynced before this returns. Returns ``size``.

    On any error (``feed``'s included) the writer's fds are closed and the file is unlinked,
    then the error propagates: a drain that failed leaves no partial data file in the area.

    Raises:
        DataFileTruncatedError: ``feed`` appended fewer than ``size`` bytes;
            CheckpointCorruptError: more.
        StorageError subclasses of the writer (DiskFullError at the fallocate or a write,
            StorageIOError, ...), and whatever ``feed`` raises.
    """
    choice = choose_backend(os.path.dirname(path))
    created = None
    try:
        with open_writer(path, choice=choice, durable=True, size_hint=size) as w:
            # The file this call made (O_EXCL), by identity: a drain's area is named after the
            # local save, so a later try (another job's, after this rank was stopped and given up
            # on) can recreate the area and this very path; a late failure here must never unlink
            # that try's file.
            created = _identity(path)
            feed(w)
            written = w.tell()
            if written < size:
                raise DataFileTruncatedError(f"{os.path.basename(path)}: the copy supplied {written} bytes, "
                                             f"expected {size}", path=path, expected=size, found=written)
            if written > size:
                raise CheckpointCorruptError(f"{os.path.basename(path)}: the copy supplied {written} bytes, "
                                             f"expected {size}", path=path, expected=size, found=written)
            w.close()  # fsync: durable before the save may commit
    except BaseException:
        if created is not None and _identity(path) == created:
            # Not the caller's abort of the whole area: a drain that fails one file leaves none of
            # it behind even if the area outlives the error (its clean-up failing too).
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    return size


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path`` (not following a symlink), or None when it cannot be looked at."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
