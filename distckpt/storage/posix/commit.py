"""Local / POSIX file-system operations of the commit protocol.

Every function here translates OSError into the typed classes of distckpt.errors (via
``from_os_error``) and closes every fd it opens before returning or raising. Data files themselves
go through distckpt.storage.posix (O_DIRECT writers); this module handles the small metadata files and the
directory operations whose ordering makes a commit atomic and durable:

  * :func:`write_file_durable`: write + fsync a small file (MANIFEST) under its final name inside a
    not-yet-visible directory;
  * :func:`replace_file_atomic`: tmp + fsync + rename + fsync(dir) for a pointer file (``latest``);
  * :func:`publish_dir`: rename (or RENAME_EXCHANGE for an overwrite) a finished tmp directory to its
    final name, then fsync the parent so the rename itself survives power loss;
  * :func:`remove_dir`: rename aside first (so a half-deleted directory never looks committed), fsync
    the parent, then delete.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from typing import Iterable

from ...errors import CheckpointExistsError, DistCkptError, from_os_error
from .paths import exchange_paths, fsync_path

__all__ = ["write_file_durable", "replace_file_atomic", "publish_dir", "remove_dir",
           "make_dir", "make_dirs_durable", "fsync_path"]


def make_dirs_durable(path: str) -> None:
    """``mkdir -p path``, then fsync the parent of every directory it created, so that the new
    directories themselves survive power loss (a checkpoint inside a directory whose own entry
    was never synced could vanish with it)."""
    path = os.path.abspath(path)
    missing = []
    probe = path
    while not os.path.isdir(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise from_os_error(exc, path=path, operation="mkdir") from exc
    for created in reversed(missing):
        fsync_path(os.path.dirname(created))


def make_dir(path: str) -> None:
    try:
        os.mkdir(path, 0o755)
    except OSError as exc:
        raise from_os_error(exc, path=path, operation="mkdir") from exc


def write_file_durable(path: str, data: bytes) -> None:
    """Create ``path`` exclusively, write ``data``, fsync, close. The fd is closed on every path."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise from_os_error(exc, path=path, operation="open") from exc
    try:
        view = memoryview(data)
        op = "write"
        try:
            while view:
                n = os.write(fd, view)
                view = view[n:]
            op = "fsync"
            os.fsync(fd)
        except OSError as exc:
            raise from_os_error(exc, path=path, operation=op, needed=len(data)) from exc
    finally:
        os.close(fd)


def replace_file_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new content, never a
    torn one: write a tmp sibling, fsync it, rename over ``path``, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        write_file_durable(tmp, data)
        try:
            os.rename(tmp, path)
        except OSError as exc:
            raise from_os_error(exc, path=path, operation="rename") from exc
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_path(directory)


def publish_dir(tmp_dir: str, final_dir: str, *, overwrite: bool) -> str | None:
    """Make ``tmp_dir`` visible as ``final_dir`` atomically and durably.

    With ``overwrite`` and an existing ``final_dir``, the two are swapped with RENAME_EXCHANGE (one
    atomic step: a crash leaves either the old or the new checkpoint under the name, never none) and
    the old one's new location (``tmp_dir``) is returned for the caller to delete; a directory that
    appeared at the name meanwhile and is not a checkpoint is refused (CheckpointExistsError).
    Otherwise a plain rename, which fails if a non-empty ``final_dir`` appeared meanwhile (an empty
    one is replaced, as rename(2) does). The parent is fsynced in both cases;
    if that fsync fails, the rename (or exchange) is undone before the error is raised, so a
    caller that reports the save as failed leaves nothing new visible.
    """
    parent = os.path.dirname(os.path.abspath(final_dir))
    fsync_path(tmp_dir)  # the entries inside (data files, MANIFEST) before the name that exposes them
    replaced = None
    try:
        if overwrite and os.path.lexists(final_dir):
            # Checked again here, not only before the save began: a directory that appeared at the
            # name meanwhile and is not a checkpoint must never be swapped out and deleted.
            if not os.path.isfile(os.path.join(final_dir, "MANIFEST")):
                raise CheckpointExistsError(
                    f"{final_dir} appeared during the save and is not a distckpt checkpoint; refusing to replace it",
                    path=final_dir, remedy="Choose another path or remove it yourself.")
            exchange_paths(tmp_dir, final_dir)
            replaced = tmp_dir
        else:
            os.rename(tmp_dir, final_dir)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and not overwrite:
            # Another save of the same path committed first (e.g. two hosts whose flock is not
            # coherent): it won; this one commits nothing and its tmp dir is removed by the caller.
            raise CheckpointExistsError(
                f"another save committed {final_dir} while this one was writing; this save was not committed",
                path=final_dir) from exc
        raise from_os_error(exc, path=final_dir, operation="rename") from exc
    try:
        fsync_path(parent)
    except DistCkptError as fsync_exc:
        # The rename is visible but not durable, and the caller will report the save as failed:
        # a failed save must commit nothing (I4), and a retry must not meet CheckpointExistsError.
        # Undo it (the exchange again, or rename back to the hidden tmp name) so the caller's
        # cleanup of ``tmp_dir`` removes the new checkpoint. Either state is complete (every file
        # was fsynced before the rename), so a crash here still loads one whole checkpoint (I1).
        try:
            if replaced is not None:
                exchange_paths(tmp_dir, final_dir)
            else:
                os.rename(final_dir, tmp_dir)
        except (OSError, DistCkptError):
            # It stays published (complete). The caller must not clean up ``tmp_dir`` now: after
            # an exchange that is the *previous* checkpoint (I2). The fsync error is still raised.
            fsync_exc.published = True
        raise
    return replaced


def remove_dir(path: str) -> None:
    """Delete a directory tree so that it never looks half-present: rename it to a hidden
    ``.NAME.del-UUID`` sibling, fsync the parent, then delete (reclaim finishes an interrupted one)."""
    parent, name = os.path.split(os.path.abspath(path))
    doomed = os.path.join(parent, f".{name}.del-{uuid.uuid4().hex}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise from_os_error(exc, path=path, operation="rename") from exc
    fsync_path(parent)
    delete_tree(doomed)


def delete_tree(path: str, *, names: Iterable[str] = ()) -> None:
    """rm -rf ``path`` (already invisible to loaders): a directory tree or a single file (a crashed
    ``latest`` replacement leaves a ``.latest.tmp-*`` file). A vanished path is not an error.

    ``names``: entries the caller knows ``path`` may hold (a save's data files and MANIFEST). They
    are unlinked and the directory removed by name first, which needs no fd: a save aborted by
    EMFILE (the fd table full) still removes its tmp dir, where rmtree, which opens every
    directory it walks, would fail the same way and leave it behind. rmtree handles the rest.
    """
    if names and os.path.isdir(path) and not os.path.islink(path):
        for name in names:
            try:
                os.unlink(os.path.join(path, name))
            except FileNotFoundError:
                pass
            except OSError:
                break  # rmtree below reports it
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            pass  # entries we did not know of (or another error): rmtree below
    if not os.path.isdir(path) or os.path.islink(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise from_os_error(exc, path=path, operation="delete") from exc
        return
    def onerror(func, p, exc_info):
        exc = exc_info[1]
        if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
            return
        raise from_os_error(exc, path=p, operation="delete") from exc
    shutil.rmtree(path, onerror=onerror)
