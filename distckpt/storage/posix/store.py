"""PosixStore: the :class:`distckpt.storage.Store` of local file systems.

It adds no behaviour: every method is the call sequence the POSIX protocol has always made (tmp
dir + save lock in PREPARE, an O_DIRECT data file per rank, MANIFEST written and fsynced inside
the tmp dir, one rename / RENAME_EXCHANGE, parent fsync), so its syscalls are exactly those the
crash tests enumerate. Where the work is done:

  * save side: :mod:`~distckpt.storage.posix.saving` (PREPARE, WRITE),
    :mod:`~distckpt.storage.posix.commit` (durable writes, the publishing rename, deletion),
    :mod:`~distckpt.storage.posix.savelock` (the save locks);
  * read side: :mod:`~distckpt.storage.posix.loading` (what a load reads, checked first),
    :mod:`~distckpt.storage.posix.manifests` (MANIFEST and indexes, with the checks of I7);
  * root side: :mod:`~distckpt.storage.posix.leftovers` (hidden leftovers, their liveness, reclaim).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Any, Callable, Mapping

from ... import manifest as mf
from ...errors import CheckpointIncompleteError, CheckpointNotFoundError, StorageError, from_os_error
from ..base import Leftover, Ownership, Store
from . import commit as local
from . import leftovers, loading, manifests, savelock
from .guards import refuse_pseudo_fs
from .probe import choose_read_backend
from .reader import open_reader

__all__ = ["PosixStore"]


class PosixStore(Store):
    kind = "posix"

    # -- save side --------------------------------------------------------------------------------

    def prepare(self, final: str, save_id: str, overwrite: bool, needed: int, rank: int,
                lock_path: str | None) -> tuple[str, Any]:
        # Imported here: writing pulls in torch (staging), and the read and root sides stay
        # torch-free for `distckpt ls` and `distckpt inspect`.
        from . import saving
        return saving.prepare_save_dir(final, save_id, overwrite, needed, rank, lock_path)

    def write_rank(self, area: str, rank: int, pieces: list, checksum_block: int) -> tuple:
        from . import saving  # torch: see prepare
        records, size, choice = saving.write_rank_file(os.path.join(area, mf.data_file_name(rank)), rank, pieces,
                                                       checksum_block)
        return records, size, choice.name, choice.reason

    def copy_data_file(self, area: str, rank: int, size: int, feed: Callable[[Any], None]) -> int:
        from . import saving  # torch: see prepare
        return saving.copy_rank_file(os.path.join(area, mf.data_file_name(rank)), size, feed)

    def publish(self, area: str, final: str, manifest: bytes, overwrite: bool) -> str | None:
        local.write_file_durable(os.path.join(area, mf.MANIFEST_NAME), manifest)
        return local.publish_dir(area, final, overwrite=overwrite)

    def abort(self, area: str, world: int) -> None:
        # Every name a save puts in its tmp dir, so an abort can remove it without an fd (EMFILE).
        local.delete_tree(area, names=[mf.MANIFEST_NAME] + [mf.data_file_name(r) for r in range(world)])

    def discard(self, replaced: str) -> None:
        local.delete_tree(replaced)

    def save_id_of_area(self, area: str) -> str:
        return os.path.basename(area).rsplit("tmp-", 1)[-1]

    def committed_save_id(self, final: str) -> str | None:
        try:
            return manifests.load_manifest_header(final).save_id
        except CheckpointIncompleteError:  # no MANIFEST there: nothing committed
            return None

    # -- read side --------------------------------------------------------------------------------

    def is_committed(self, path: str) -> bool:
        return manifests.is_committed(path)

    def manifest_bytes(self, path: str) -> bytes:
        return loading.manifest_bytes(path)

    def read_index(self, path: str, header: "mf.Manifest", i: int) -> bytes:
        data = manifests.read_local_index(path, header.files[i])
        mf.check_index_bytes(header, i, data, os.path.join(path, header.files[i].name))
        return data

    def peek_commit_time(self, path: str) -> float | None:
        return manifests.peek_commit_time(path)

    def data_readers(self, path: str, manifest: "mf.Manifest", file_indexes: list[int], *,
                     piece: int | None = None) -> tuple[Mapping[int, str], Callable[[str], Any], int, str]:
        return loading.data_readers(path, manifest, file_indexes, piece=piece)

    def guard_reads(self, path: str) -> contextlib.AbstractContextManager:
        return loading.guard_reads(path)

    def data_file_stat(self, path: str, manifest: "mf.Manifest", i: int) -> tuple[str, int | None, str | None]:
        entry = manifest.files[i]
        fpath = os.path.join(path, entry.name)
        try:
            st = os.lstat(fpath)  # lstat: a data file must be a regular file inside the checkpoint (I7)
        except FileNotFoundError:
            return fpath, None, "missing (listed in MANIFEST)"
        except OSError as exc:
            raise from_os_error(exc, path=fpath, operation="stat") from exc
        if not stat.S_ISREG(st.st_mode):
            kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                    else "not a regular file")
            return fpath, None, f"is {kind}; a data file must be a regular file"
        return fpath, st.st_size, None

    def whole_file_readers(self, sizes: Mapping[str, int]) -> tuple[Callable[[str], Any], str | None]:
        # One backend for every file of the checkpoint (one file system), chosen on a file that is
        # there: choosing reads, never writes a probe file into the checkpoint.
        choice = choose_read_backend(next(iter(sizes))) if sizes else None
        return (lambda p: open_reader(p, choice=choice)), (choice.name if choice is not None else None)

    # -- root side --------------------------------------------------------------------------------

    def check_root(self, root: str) -> None:
        refuse_pseudo_fs(root)

    def make_root(self, root: str) -> None:
        local.make_dirs_durable(root)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def has_manifest(self, path: str) -> bool:
        return os.path.lexists(os.path.join(path, mf.MANIFEST_NAME))

    def list_children(self, root: str) -> list[str]:
        try:
            names = sorted(os.listdir(root))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise CheckpointNotFoundError(
                f"{root} is not a directory", path=root,
                remedy="Check the path: pass a CheckpointManager root or a checkpoint directory.") from None
        except OSError as exc:
            raise from_os_error(exc, path=root, operation="list") from exc
        # Hidden names are leftovers of saves (scan_leftovers); a symlink is never followed, so
        # rotation cannot delete through one.
        return [n for n in names if not n.startswith(".") and os.path.isdir(os.path.join(root, n))
                and not os.path.islink(os.path.join(root, n))]

    def read_pointer(self, path: str) -> str | None:
        # O_NONBLOCK: a FIFO planted as ``latest`` must not block the open (it hung `distckpt ls`
        # and describe()); O_NOFOLLOW: a symlink could point anywhere, and a reader quotes no
        # byte of a file distckpt did not write. Both are refused below, typed.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StorageError(f"{path} is a symbolic link, not a file distckpt wrote (it is not followed)",
                                   path=path, errno=exc.errno,
                                   remedy="Remove it; the next save writes it again.") from None
            raise from_os_error(exc, path=path, operation="read") from exc
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                        "a socket" if stat.S_ISSOCK(mode) else "a device")
                raise StorageError(f"{path} is {kind}, not a file distckpt wrote", path=path, errno=errno.EINVAL,
                                   remedy="Remove it; the next save writes it again.")
            return os.read(fd, 4096).decode("utf-8", "replace").strip()
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise from_os_error(exc, path=path, operation="read") from exc
        finally:
            os.close(fd)

    def replace_pointer(self, path: str, data: bytes) -> None:
        local.replace_file_atomic(path, data)

    def remove_checkpoint(self, path: str) -> None:
        local.remove_dir(path)

    def take_ownership(self, path: str, *, owner_id: str, what: str, extra: Mapping[str, Any],
                       holder_dead: Callable[[dict], bool]) -> Ownership:
        # A flock: a dead holder's is already free, so holder_dead is never needed here.
        return savelock.acquire(path, save_id=owner_id, what=what, extra=dict(extra))

    def scan_leftovers(self, root: str, *, other_hosts: bool = False) -> list[Leftover]:
        return leftovers.scan_leftovers(root, other_hosts=other_hosts)

    def bytes_under(self, path: str) -> int | None:
        return leftovers.tree_bytes(path) if os.path.isdir(path) else None

    def replaced_checkpoint(self, path: str) -> bool | None:
        # RENAME_EXCHANGE leaves the old checkpoint under the new save's tmp name: its MANIFEST
        # names another save than the area's. A save killed after writing its own MANIFEST but
        # before the exchange leaves one that names itself: that is an interrupted save.
        try:
            return manifests.load_manifest_header(path).save_id != self.save_id_of_area(path)
        except Exception:  # noqa: BLE001 - no MANIFEST, or an unreadable one: not a checkpoint
            return False

    def reclaim(self, root: str, *, other_hosts: bool = False,
                only: Callable[[str], bool] | None = None) -> list[str]:
        return leftovers.reclaim_tmp_dirs(root, other_hosts=other_hosts, only=only)
